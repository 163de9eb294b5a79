#!/usr/bin/python3
"""Roofline model of kvevict's CUDA kernels (docs/cuda.md, "Performance model").

For every kernel the CUDA header launches, as it is written today, the model counts what the
kernel moves and computes at a given shape (HBM and L2 bytes, FP32 FLOPs, shared-memory
wavefronts and shuffles, exponentials, the longest dependent chain of memory accesses) and
turns each count into a time with a table of peak rates; the largest is the kernel's bound and
names its binding resource. A kernel never takes less than one launch (`launch_us`). An API
call's time is the sum of its kernels' (they run in stream order). The same is done for the
PyTorch kvpress pipeline, op by op.

These are models, not measurements: the counts come from reading the kernels and their PTX
(nvcc 13.0, sm_90), the peak rates from data sheets and stated assumptions. scripts/gpu-check
measures every kernel and prints measured time, modelled time and the fraction of the bound
achieved (the `compare` command).

  gpu-model.py table [--tokens L] [--window W] [--gpu h200]   markdown tables, one shape
  gpu-model.py docs                                            the tables of docs/cuda.md
  gpu-model.py compare BENCH.txt [TORCH.txt]                   measured vs modelled (gpu-check)
  gpu-model.py self-test                                       checks of the model itself (ctest)

Python standard library only; run with /usr/bin/python3 or any python3.
"""
import argparse
import math
import re
import sys
from dataclasses import dataclass, field, replace

# ---- peak rates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    clock_ghz: float          # SM clock under load (boost)
    hbm_gbs: float            # HBM bandwidth, GB/s (1e9)
    l2_gbs: float             # L2 read bandwidth, GB/s (assumed: no vendor figure)
    l2_mib: float
    tensor_bf16_tflops: float  # dense
    fp32_lanes: int = 128      # FP32 FMA lanes per SM (2 FLOP each per clock)
    mio_per_clk: float = 1.0   # shared-memory wavefronts (128 B) or shuffles per clock per SM
    mufu_per_clk: float = 16.0  # ex2 results per clock per SM (CUDA guide, cc 8.0/9.0)
    launch_us: float = 4.0     # floor of one kernel launch in a stream (assumed, 3-5 us)
    l2_latency_cycles: float = 350.0  # one dependent L2-hit access incl. issue (assumed)
    hbm_latency_cycles: float = 700.0
    regs_per_sm: int = 65536
    smem_per_sm: int = 233472  # 228 KiB
    threads_per_sm: int = 2048
    blocks_per_sm: int = 32

    @property
    def fp32_tflops(self):
        return self.sms * self.fp32_lanes * 2 * self.clock_ghz * 1e9 / 1e12


GPUS = {
    # H200 SXM: HBM3e 4.8 TB/s, 132 SMs at 1.98 GHz (FP32 66.9 TFLOP/s), BF16 dense 989 TFLOP/s.
    "h200": Gpu("H200 SXM (data sheet)", 132, 1.98, 4800.0, 5500.0, 50.0, 989.0),
    "h100": Gpu("H100 SXM (data sheet)", 132, 1.98, 3350.0, 5500.0, 50.0, 989.0),
}

# decode_logits_kernel per group bucket (bf16 keys, 16-byte loads, the larger of its two pass
# counts; __launch_bounds__(256, 2) for buckets <= 4): 1, 2 and 4 fit two blocks per SM, 8 one.
DECODE_REGS = {1: 84, 2: 88, 4: 118, 8: 231}

# Registers per thread from `ptxas -v` (nvcc 13.0, sm_90, bf16 instantiations of bench_gpu.cu);
# they set how many blocks an SM holds.
REGS = {"obs_tile_kernel": 40, "row_lse_kernel": 23, "finalize_kernel": 56, "obs_state_kernel": 32,
        "decode_logits_kernel": 96, "decode_update_kernel": 32, "select_prepare_kernel": 30,
        "select_rows_kernel": 47, "compact_validate_kernel": 30, "compact_move_kernel": 64}


@dataclass(frozen=True)
class Shape:
    hq: int = 32
    hkv: int = 8
    d: int = 128
    tokens: int = 32768
    window: int = 32
    budget: int = 2048
    elem: int = 2          # bytes per K/V element (bf16)
    layers: int = 32       # rows of the whole-model selection: layers x hkv
    pool: int = 5

    @property
    def group(self):
        return self.hq // self.hkv

    @property
    def cand(self):  # C = L - P with the protected tail P = W
        return max(0, self.tokens - self.window)


# ---- kernel records -------------------------------------------------------------------------

@dataclass
class Kernel:
    name: str                  # the CUDA function's base name (matched against measurements)
    label: str
    blocks: int
    threads: int
    smem: int = 0
    hbm_bytes: float = 0.0
    l2_bytes: float = 0.0
    fp32_flops: float = 0.0    # FFMA work (2 FLOP per FMA)
    fma_per_block: float = 0.0  # FFMA warp instructions per block (per-SM issue bound)
    mio_per_block: float = 0.0  # shared-memory wavefronts + shuffles per block
    mufu_per_block: float = 0.0  # exponentials (thread ops) per block
    chain_cycles: float = 0.0  # longest dependent chain of one block, in cycles
    tensor_flops: float = 0.0
    chain_is_total: bool = False  # chain_cycles already covers every block's work (grid-stride kernels)
    regs: int = 0              # registers per thread when they depend on the instantiation (else REGS)
    note: str = ""
    times: dict = field(default_factory=dict)

    def resident(self, g: Gpu):
        regs = self.regs or REGS.get(self.name, 32)
        regs_block = math.ceil(regs * self.threads / 256) * 256
        by_regs = g.regs_per_sm // regs_block
        by_threads = g.threads_per_sm // self.threads
        by_smem = g.smem_per_sm // (self.smem + 1024) if self.smem else g.blocks_per_sm
        return max(1, min(by_regs, by_threads, by_smem, g.blocks_per_sm))

    def evaluate(self, g: Gpu):
        """Time of each resource, in microseconds; the bound is their maximum."""
        clock = g.clock_ghz * 1e9
        per_sm_blocks = math.ceil(self.blocks / g.sms)  # the busiest SM's share (wave quantisation)
        waves = 1 if self.chain_is_total else math.ceil(self.blocks / (g.sms * self.resident(g)))
        t = {
            "HBM": self.hbm_bytes / (g.hbm_gbs * 1e9) * 1e6,
            "L2": self.l2_bytes / (g.l2_gbs * 1e9) * 1e6,
            "FP32": per_sm_blocks * self.fma_per_block / 4 / clock * 1e6,  # 4 warp-FFMA per clock per SM
            "SMEM": per_sm_blocks * self.mio_per_block / g.mio_per_clk / clock * 1e6,
            "MUFU": per_sm_blocks * self.mufu_per_block / g.mufu_per_clk / clock * 1e6,
            "latency": waves * self.chain_cycles / clock * 1e6,
            "tensor": self.tensor_flops / (g.tensor_bf16_tflops * 1e12) * 1e6,
            "launch": g.launch_us,
        }
        self.times = t
        return t

    def bound(self, g: Gpu):
        t = self.evaluate(g)
        res = max(t, key=lambda k: t[k])
        return t[res], res

    def device_bound(self, g: Gpu):
        """The bound without the launch floor: what the kernel's own work needs on the GPU."""
        t = dict(self.evaluate(g))
        del t["launch"]
        res = max(t, key=lambda k: t[k])
        return t[res], res


def ceil_div(a, b):
    return -(-a // b)


# ---- shared-memory bank model ---------------------------------------------------------------

def wavefronts(addresses):
    """Shared-memory wavefronts of one warp access: the most distinct 4-byte words any of the
    32 banks must deliver (broadcast of equal words is free)."""
    banks = {}
    for a in addresses:
        for w in range(a[0] // 4, (a[0] + a[1]) // 4):
            banks.setdefault(w % 32, set()).add(w)
    return max(len(s) for s in banks.values()) if banks else 0


def decode_query_wavefronts(elem):
    """Wavefronts of one warp reloading one query row's 8-channel slice per lane from shared
    memory (G > 8 or d > 128 only), as LDS.128: with Vec = 4 (float keys) lane l of each
    half-warp reads channels it * 64 + 4 l .. + 3; with Vec = 8 the row is stored so that its
    two halves are 64 words apart and lanes 4 words apart (decode_query_slot). Both
    half-warps read the same words."""
    vec = min(16 // elem, 8)
    total = 0
    for it in range(8 // vec):
        for half in range(vec // 4):
            total += wavefronts([((it * 64 + half * 64 + (lane % 16) * 4) * 4, 16) for lane in range(32)])
    return total


def transpose_reduce_shuffles(n):
    """Shuffles of one transpose-reduce of n partial sums over 16 lanes (offsets 8, 4, 2, 1):
    a lane sends half of its remaining values at each step, a plain butterfly once one is left."""
    total = 0
    for _ in range(4):
        total += n // 2 if n >= 2 else 1
        n = max(1, n // 2)
    return total


def decode_bucket(group):
    """Query heads per register chunk (decode_group_bucket): 1, 2, 4 or 8; G > 8 in chunks of 8."""
    return 1 if group <= 1 else 2 if group <= 2 else 4 if group <= 4 else 8


# ---- the kernels of each API call -----------------------------------------------------------

OBS_TK, OBS_RT, OBS_DC, DEC_TK, FIN_TK, SEL_THREADS, SEL_TILE = 64, 64, 32, 256, 256, 512, 4096
DEC_PANEL, DEC_KEYS_IN_FLIGHT = 128, 4  # channels per panel (16 lanes x 8), keys per half-warp


def tensor_cores(s: Shape):
    """bf16/fp16 keys with queries of the same type, and fp8 keys (widened to the 16-bit query
    type in shared memory) score on tensor cores; float32 on FP32 cores."""
    return s.elem in (1, 2)


def mma_key_words(d):
    return ceil_div(d, 16) * 8 + 4


MMA_QUERY_WORDS = 64 // 2 + 4


def obs_smem(s: Shape, accumulate):
    b = (s.window + 2 * OBS_TK) * 8
    p = OBS_RT * (OBS_TK + 1)
    if tensor_cores(s):
        b += OBS_TK * mma_key_words(s.d) * 4 + max(OBS_RT * MMA_QUERY_WORDS, p) * 4
    else:
        q = OBS_RT * (OBS_DC + 1)
        b += OBS_TK * (s.d + 1) * 4 + (max(q, p) if accumulate else q) * 4
    if accumulate:
        b += (s.group * OBS_TK + s.window) * 4
    return b


def mma_tile_wavefronts(d):
    """Shared-memory wavefronts per warp for one 16 x 32 slice of the 64 x 64 logit tile on
    tensor cores: per 16 channels, A's four words and B's 2 x 4 (LDS.32, conflict-free thanks
    to the 4-word pads), then the scaled logits through the scratch tile ([64][65] floats):
    16 STS.32 in the fragment layout, 16 LDS.32 in the epilogue's."""
    frag = ceil_div(d, 16) * 12
    write = 0
    for n in range(4):
        for r in (0, 8):
            for c in (0, 1):
                write += wavefronts([(((lane // 4 + r) * 65 + 8 * n + 2 * (lane % 4) + c) * 4, 4) for lane in range(32)])
    read = 0
    for i in range(4):
        for k in range(4):
            read += wavefronts([(((lane // 16 + 16 * i) * 65 + lane % 16 + 16 * k) * 4, 4) for lane in range(32)])
    return frag + write + read


def fits_l2(g: Gpu, nbytes):
    """Intermediates written by the previous kernel and read back: L2 hits when they fit in
    half of L2 (the rest of L2 holds the kernel's streaming data)."""
    return nbytes <= g.l2_mib * 2**20 / 2


def obs_tile(s: Shape, g: Gpu, accumulate):
    keys = s.cand if accumulate else s.tokens  # visible domain: the softmax covers every key
    rows = s.group * s.window
    tiles = ceil_div(keys, OBS_TK)
    rchunks = ceil_div(rows, OBS_RT)
    dchunks = ceil_div(s.d, OBS_DC)
    blocks = tiles * s.hkv
    k_bytes = s.hkv * keys * s.d * s.elem
    q_bytes = blocks * rows * s.d * s.elem  # every block stages all G*W queries (L2 hits)
    if tensor_cores(s):
        # Per row chunk, each warp computes a 16 x 32 slice with 4 m16n8k16 MMAs per 16
        # channels; the queries are staged 64 channels at a time as 16-bit pairs (8 STS.32 per
        # thread), the K tile once (ceil(64 * words / 256) STS.32 per thread).
        dpad = ceil_div(s.d, 16) * 16
        lds = rchunks * 8 * mma_tile_wavefronts(s.d)
        fma = 0
        staging = 8 * ceil_div(OBS_TK * mma_key_words(s.d), 256) + rchunks * ceil_div(dpad, 64) * 8 * 8
        tensor = 2.0 * s.hkv * rchunks * OBS_RT * tiles * OBS_TK * dpad
        note = "tensor cores: 12 LDS.32 per 4 MMA, logits through shared memory"
    else:
        # Per channel, each thread loads 4 query and 4 key values (LDS.32, conflict-free thanks
        # to the +1 pads) for 16 FFMA: 8 LDS per 16 FFMA.
        lds = rchunks * s.d * 8 * 8            # warp-LDS per block (8 warps)
        fma = rchunks * s.d * 16 * 8           # warp-FFMA per block
        staging = 2 * s.d + rchunks * dchunks * 8 * 8   # STS of the K tile and query chunks
        tensor = 0.0
        note = "4x4 register tile: 8 LDS.32 per 16 FFMA"
    mufu = rchunks * OBS_RT * OBS_TK
    if accumulate:
        rows_per_g = min(s.window, OBS_RT)
        pairs = ceil_div(OBS_RT, s.window) * OBS_TK if s.window < OBS_RT else OBS_TK
        epilogue = rchunks * (8 * 16 * 2 + ceil_div(pairs, 32) * (2 * rows_per_g + 2))
        out_bytes = s.hq * keys * 4
        hbm = k_bytes + out_bytes
        l2 = q_bytes + k_bytes + s.hkv * rows * 4
        label = "accumulate (probabilities, window sum)"
    else:
        epilogue = rchunks * 8 * 32  # 2 x 4 butterfly steps for 4 rows per thread
        partial_bytes = s.hkv * rows * tiles * 8
        hbm = k_bytes + partial_bytes
        l2 = q_bytes + k_bytes
        label = "stats (tile max, sum exp)"
    return Kernel("obs_tile_kernel", label, blocks, 256, obs_smem(s, accumulate), hbm_bytes=hbm, l2_bytes=l2,
                  fp32_flops=0.0 if tensor else 2.0 * s.hkv * rchunks * OBS_RT * tiles * OBS_TK * s.d,
                  fma_per_block=fma, mio_per_block=lds + staging + epilogue, mufu_per_block=mufu,
                  tensor_flops=tensor, note=note)


def row_lse(s: Shape, g: Gpu, rows, tiles):
    nbytes = rows * tiles * 8 + rows * 4
    # One warp per row: each lane folds ceil(tiles/32) partials (two exp and a division each,
    # about 40 dependent cycles), then 5 butterfly steps.
    chain = g.l2_latency_cycles + ceil_div(tiles, 32) * 40 + 5 * 60
    return Kernel("row_lse_kernel", "row LSE (fold partials)", ceil_div(rows, 8), 256, l2_bytes=nbytes,
                  chain_cycles=chain, mufu_per_block=8 * tiles * 2)


def finalize(s: Shape, g: Gpu, rows_per_head):
    radius = s.pool // 2
    tiles = ceil_div(s.tokens, FIN_TK)
    acc = s.hkv * rows_per_head * (s.cand + tiles * 2 * radius) * 4
    out = s.hkv * s.tokens * 4
    return Kernel("finalize_kernel", "finalize (normalise, GQA, pool)", tiles * s.hkv, 256,
                  3 * (FIN_TK + 2 * radius) * 4, hbm_bytes=out + (0 if fits_l2(g, acc) else acc),
                  l2_bytes=acc + out, chain_cycles=g.l2_latency_cycles * (2 + rows_per_head))


def key_norm(s: Shape, g: Gpu):
    """KNorm's scores: one thread per (head, token) row, the squares summed in double. A warp's
    32 rows are 32 cache lines per channel step, reused from L1 over the row, so K is read
    from HBM about once; the double adds are a short chain per row (d dependent DADDs)."""
    k_bytes = s.hkv * s.tokens * s.d * s.elem
    out = s.hkv * s.tokens * 4
    return Kernel("key_norm_kernel", "key norms (KNorm), one thread per row", ceil_div(s.tokens, 256) * s.hkv, 256,
                  hbm_bytes=k_bytes + out, l2_bytes=k_bytes + out,
                  chain_cycles=g.hbm_latency_cycles + s.d * 8)


def keydiff_kernels(s: Shape, g: Gpu):
    """KeyDiff's scores, four launches in the CPU's summation order: the rows' norms (one thread
    per row, as key_norm, double out), each chunk of 256 tokens' channel sums (one thread per
    channel and chunk: K read a second time, a chain of 256 DFMAs), the anchor (one block per
    head: the chunks' sums, then thread 0's d squares), the scores (one thread per row: K read a
    third time, a chain of d DFMAs). Beyond the first pass K comes from HBM again when it does
    not fit L2."""
    k_bytes = s.hkv * s.tokens * s.d * s.elem
    norms = s.hkv * s.tokens * 8
    chunks = ceil_div(s.tokens, 256)
    sums = s.hkv * chunks * s.d * 8
    k_again = 0 if fits_l2(g, k_bytes) else k_bytes
    out = s.hkv * s.tokens * 4
    return [
        Kernel("keydiff_norm_kernel", "KeyDiff: key norms, one thread per row", ceil_div(s.tokens, 256) * s.hkv, 256,
               hbm_bytes=k_bytes + norms, l2_bytes=k_bytes + norms, chain_cycles=g.hbm_latency_cycles + s.d * 8),
        Kernel("keydiff_chunk_kernel", "KeyDiff: channel sums per chunk of 256", chunks * s.hkv, 128,
               hbm_bytes=k_again + sums, l2_bytes=k_bytes + norms + sums,
               chain_cycles=g.hbm_latency_cycles + 256 * 8 * ceil_div(s.d, 128)),
        Kernel("keydiff_anchor_kernel", "KeyDiff: anchor and its norm, a block per head", s.hkv, 128,
               l2_bytes=sums + s.hkv * s.d * 8, chain_cycles=g.l2_latency_cycles + chunks * 8 + s.d * 8),
        Kernel("keydiff_score_kernel", "KeyDiff: cosine to the anchor, one thread per row",
               ceil_div(s.tokens, 256) * s.hkv, 256, hbm_bytes=k_again + out, l2_bytes=k_bytes + norms + out,
               chain_cycles=g.hbm_latency_cycles + s.d * 8),
    ]


def head_mean(s: Shape, g: Gpu):
    """TOVA's mean across KV heads: one thread per token, Hkv scores read and written, a chain
    of Hkv double additions."""
    n = s.hkv * s.tokens * 4
    return Kernel("head_mean_kernel", "mean across KV heads (TOVA)", ceil_div(s.tokens, 256), 256,
                  hbm_bytes=2 * n, l2_bytes=2 * n, chain_cycles=g.hbm_latency_cycles + s.hkv * 8)


def rerotate(s: Shape, g: Gpu):
    """DapQ's re-rotated window: a block per query row, a thread per rotated pair; the queries
    read and written once, the table from L2; a few dependent double operations per pair."""
    q_bytes = s.hq * s.window * s.d * s.elem
    return Kernel("rerotate_kernel", "window queries moved W positions on", s.hq * s.window, 128,
                  hbm_bytes=2 * q_bytes, l2_bytes=2 * q_bytes + s.hq * s.window * s.d * 8,
                  chain_cycles=g.hbm_latency_cycles + g.l2_latency_cycles + 4 * 8)


def obs_state(s: Shape, g: Gpu):
    n = s.hkv * s.cand
    acc = s.hq * s.cand * 4
    return Kernel("obs_state_kernel", "fold into the running state", min(ceil_div(n, 256), 4096), 256,
                  hbm_bytes=2 * n * 4 + (0 if fits_l2(g, acc) else acc), l2_bytes=acc + 2 * n * 4,
                  chain_cycles=g.hbm_latency_cycles * 2)


def decode_logits(s: Shape, g: Gpu, one_pass):
    keys = s.tokens  # the decode step's state covers every key (P = 0, as the benchmark runs it)
    tiles = ceil_div(keys, DEC_TK)
    blocks = tiles * s.hkv
    gb = decode_bucket(s.group)
    chunks = 1 if gb < 8 else ceil_div(s.group, 8)
    panels = ceil_div(s.d, DEC_PANEL)
    resident = chunks == 1 and panels == 1
    u = DEC_KEYS_IN_FLIGHT
    warps, sweeps = 8, DEC_TK // (16 * u)  # each half-warp: 4 sweeps of 4 keys
    n = gb * u
    # Per warp and sweep (8 keys): the transpose-reduce of each chunk, the lanes' STS of the
    # finished logits (rows 264 words apart: conflict-free), and, unless the queries stay in
    # registers, their reload per chunk and panel.
    shfl = chunks * transpose_reduce_shuffles(n)
    sts = chunks * max(1, n // 16)
    lds = 0 if resident else chunks * panels * gb * decode_query_wavefronts(s.elem)
    per_sweep = shfl + sts + lds
    qrows = chunks * gb
    staging = ceil_div(qrows * panels * DEC_PANEL, 256) * 8 + 2 * gb * 8  # STS of the queries, one slice load
    mio = warps * sweeps * per_sweep + staging
    # FFMA per lane and sweep: 4 keys x GB heads x 8 channels per chunk and panel (absent heads
    # included); widening the keys to float costs about one ALU op per element for 16-bit keys
    # and two for fp8, issued with the FMAs.
    widen = {4: 0, 2: 1, 1: 2}[s.elem]
    fma = warps * sweeps * chunks * panels * u * 8 * (gb + widen)
    hbm_k = s.hkv * keys * s.d * s.elem
    # G > 8 keeps the keys' slices in registers across chunks when d <= 128; with more panels
    # it re-reads the rows per chunk (L1, counted as L2).
    l2 = hbm_k * (1 if panels == 1 else chunks)
    if one_pass:
        mio += s.group * ceil_div(DEC_TK, 32) * 8
        hbm = hbm_k + 2 * s.hkv * keys * 4
        label = "logits + softmax + state (engine LSE)"
    else:
        mio += s.group * (2 * DEC_TK // 32 + 10)
        hbm = hbm_k + s.hq * keys * 4 + s.hq * tiles * 8
        label = "logits + tile partials"
    mufu = DEC_TK * s.group
    # Latency: a block stages its queries (one L2 round trip and a barrier), then each warp
    # runs 4 sweeps that each wait for their 4 keys' loads (one HBM latency, the loads of a
    # sweep in flight together), issue the FMAs and the 4 dependent shuffle steps; the
    # epilogue reads the tile from shared memory. With `resident` blocks per SM this is
    # Little's law for the bytes in flight. Bucket 8 with 8-element loads issues the next
    # sweep's loads before computing (one block per SM): after the first sweep, a sweep
    # takes (latency + compute) / 2 in the steady state.
    compute = 4 * 25 + chunks * panels * u * 8 * (gb + widen) / 2
    sweep_cycles = g.hbm_latency_cycles + compute
    prefetch = gb == 8 and s.elem < 4
    body = sweep_cycles * (1 + (sweeps - 1) / 2) if prefetch else sweeps * sweep_cycles
    chain = g.l2_latency_cycles + 50 + body + 300
    sm_bytes = DEC_TK // sweeps * s.d * s.elem
    note = (f"{per_sweep} shuffles+wavefronts per 8 keys, queries {'in registers' if resident else 'reloaded'}, "
            f"{sm_bytes // 1024 * (2 if prefetch else 1)} KiB of K in flight per block")
    return Kernel("decode_logits_kernel", label, blocks, 256,
                  (qrows * panels * DEC_PANEL + s.group * (DEC_TK + 8)) * 4, hbm_bytes=hbm, l2_bytes=l2,
                  fp32_flops=2.0 * s.hq * keys * s.d, fma_per_block=fma, mio_per_block=mio, mufu_per_block=mufu,
                  chain_cycles=chain, regs=DECODE_REGS[gb], note=note)


def decode_update(s: Shape, g: Gpu):
    logits = s.hq * s.tokens * 4
    state = 2 * s.hkv * s.tokens * 4
    return Kernel("decode_update_kernel", "probabilities + state", ceil_div(s.tokens, DEC_TK) * s.hkv, 256,
                  s.group * 4, hbm_bytes=state + (0 if fits_l2(g, logits) else logits), l2_bytes=logits + state,
                  mufu_per_block=DEC_TK * s.group, chain_cycles=g.hbm_latency_cycles * 2)


def select_kernels(s: Shape, g: Gpu, rows):
    cand = s.cand
    k = s.budget - s.window
    nbytes = rows * s.tokens * 4
    sweeps = 4 + 1  # four radix passes (no early exit on distinct scores) and the emission sweep
    # Chain of one block: per pass, ceil(cand/512) steps that each wait for one L2 load (the
    # PTX keeps the loads between __match_any_sync and the shared atomics; ptxas may overlap
    # the 4 unrolled ones, which would divide this by up to 4), plus barriers and the bucket
    # search; the emission sweep: per 4096-key tile one load latency and a block scan.
    steps = ceil_div(cand, SEL_THREADS)
    chain = 4 * (steps * (g.l2_latency_cycles + 40) + 400) + ceil_div(cand, SEL_TILE) * (g.l2_latency_cycles + 300)
    prep = Kernel("select_prepare_kernel", "prefix sum of kept counts, row descriptors", 1, 1024,
                  chain_cycles=ceil_div(rows, 1024) * 800 + g.hbm_latency_cycles)
    sel = Kernel("select_rows_kernel", f"radix select, {rows} rows", rows, SEL_THREADS,
                 hbm_bytes=(0 if fits_l2(g, nbytes) else nbytes) + rows * s.budget * 8,
                 l2_bytes=sweeps * nbytes, chain_cycles=chain if k < cand else 0,
                 note="one block per row, latency-bound")
    return [prep, sel]


def compact_kernels(s: Shape, g: Gpu):
    cap = s.hkv * s.budget
    row = 2 * s.d * s.elem  # K and V
    moved = cap * row
    blocks = min(ceil_div(cap * max(s.d, 32) + s.hkv + s.tokens, 256), 8192)
    bsearch = max(1, math.ceil(math.log2(s.hkv + 1)))
    resident_warps = g.sms * Kernel("compact_move_kernel", "", 1, 256).resident(g) * 8
    rounds = ceil_div(cap, resident_warps)
    memset = Kernel("memset", "clear the status word (cudaMemsetAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    validate = Kernel("compact_validate_kernel", "validate keep-list and block ids", blocks, 256,
                      l2_bytes=cap * 8 * 3 + (s.hkv + 1) * 8,
                      chain_cycles=(bsearch + 2) * g.l2_latency_cycles, chain_is_total=True)
    gather = Kernel("compact_move_kernel", "gather kept rows -> workspace", blocks, 256,
                    hbm_bytes=moved + (0 if fits_l2(g, moved) else moved), l2_bytes=2 * moved + cap * 8,
                    chain_cycles=rounds * (bsearch * 40 + g.l2_latency_cycles + g.hbm_latency_cycles),
                    chain_is_total=True, note="a warp per entry; most of the 8192 blocks find no entry")
    scatter = Kernel("compact_move_kernel", "scatter workspace -> rows", blocks, 256,
                     hbm_bytes=moved + (0 if fits_l2(g, moved) else moved), l2_bytes=2 * moved + cap * 16,
                     chain_cycles=rounds * (bsearch * 40 + 2 * g.l2_latency_cycles), chain_is_total=True)
    return [memset, validate, gather, scatter]


BATCH = 8  # sequences of the benchmark's batched scoring (bench_gpu.cu "obs_batch")


def batched(k: Kernel, n, name):
    """A kernel of the batched entry: the single-sequence kernel's blocks for each of n
    sequences in one grid (blockIdx.z), its per-block work unchanged."""
    return replace(k, name=name, blocks=k.blocks * n, hbm_bytes=k.hbm_bytes * n, l2_bytes=k.l2_bytes * n,
                   fp32_flops=k.fp32_flops * n, tensor_flops=k.tensor_flops * n, times={})


def obs_batch_kernels(s: Shape, g: Gpu, n):
    one = replace(s, tokens=s.tokens // n)
    rows = one.group * one.window
    copy = Kernel("memcpy", "descriptors to the device (cudaMemcpyAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    return [copy, batched(obs_tile(one, g, False), n, "obs_tile_batch_kernel"),
            batched(row_lse(one, g, one.hkv * rows, ceil_div(one.tokens, OBS_TK)), n, "obs_row_lse_batch_kernel"),
            batched(obs_tile(one, g, True), n, "obs_tile_batch_kernel"),
            batched(finalize(one, g, one.group), n, "finalize_batch_kernel")]


WIDE_FROM = 16384      # rows of at least this many keys take select_rows_wide (cuda/select_wide.cuh)
WIDE_MAX_BLOCKS = 128  # blocks per row at most


def select_wide_kernels(g: Gpu, n, rows, kept):
    """select_rows_wide: rows of n keys cut into tiles of 4,096 keys over up to 128 blocks a
    row; a memset, four histogram passes (each block: one warp derives the state from the last
    pass's histogram, then its keys one load per 512, then 256 global atomics), each block's
    counts, then the emission (the earlier blocks' counts, then a scan per tile)."""
    tiles = ceil_div(max(n, 1), SEL_TILE)
    blocks = min(WIDE_MAX_BLOCKS, tiles)
    per_block = ceil_div(tiles, blocks) * SEL_TILE
    steps = ceil_div(per_block, SEL_THREADS)
    state = 8 * g.l2_latency_cycles + 400  # the lanes' 8 bucket loads, the scan, the barrier
    memset = Kernel("memset", "clear the rows' histograms (cudaMemsetAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    hist = Kernel("select_wide_hist_kernel", f"histogram pass, {blocks} blocks x {rows} rows", blocks * rows,
                  SEL_THREADS, l2_bytes=rows * n * 4,
                  chain_cycles=state + steps * (g.l2_latency_cycles + 40) + 2 * g.l2_latency_cycles,
                  note="one pass; four launches")
    count = Kernel("select_wide_count_kernel", "each block's keys above the threshold and ties", blocks * rows,
                   SEL_THREADS, l2_bytes=rows * n * 4, chain_cycles=state + steps * 40 + g.l2_latency_cycles + 400)
    emit = Kernel("select_wide_emit_kernel", "earlier blocks' counts, a scan per tile, the kept indices",
                  blocks * rows, SEL_THREADS, hbm_bytes=kept * 8, l2_bytes=rows * n * 4,
                  chain_cycles=state + 2 * g.l2_latency_cycles + 400 + ceil_div(per_block, SEL_TILE) *
                  (g.l2_latency_cycles + 300))
    return [memset, hist, hist, hist, hist, count, emit]


def adakv_kernels(s: Shape, g: Gpu):
    """Flatten the layer's candidates into one row, the radix select of its top Hkv*B (from
    16 Ki keys the wide selection, many blocks per row; below, one block), then one block's
    per-head counts."""
    flat = s.hkv * s.cand
    flatten = Kernel("adakv_flatten_kernel", "candidates -> one row", min(ceil_div(flat, 256), 4096), 256,
                     hbm_bytes=flat * 4, l2_bytes=2 * flat * 4, chain_cycles=2 * g.hbm_latency_cycles)
    count = Kernel("adakv_count_kernel", "per-head picks -> budgets", 1, 256,
                   chain_cycles=2 * math.ceil(math.log2(s.hkv * s.budget + 1)) * g.l2_latency_cycles)
    if flat >= WIDE_FROM:
        return [flatten] + select_wide_kernels(g, flat, 1, s.hkv * s.budget) + [count]
    steps = ceil_div(flat, SEL_THREADS)
    chain = 4 * (steps * (g.l2_latency_cycles + 40) + 400) + ceil_div(flat, SEL_TILE) * (g.l2_latency_cycles + 300)
    select = Kernel("select_rows_kernel", f"radix select, 1 row of {flat}", 1, SEL_THREADS,
                    hbm_bytes=s.hkv * s.budget * 8, l2_bytes=5 * flat * 4, chain_cycles=chain,
                    note="one block: the whole layer's candidates in one row")
    return [flatten, select, count]


def per_head_select(s: Shape, g: Gpu, budget):
    """Each head's own top `budget` over its descriptors (no prepare kernel): a block per head,
    or from 16 Ki candidates the wide selection."""
    if s.cand >= WIDE_FROM:
        return select_wide_kernels(g, s.cand, s.hkv, s.hkv * budget)
    return [k for k in select_kernels(replace(s, budget=budget), g, s.hkv) if k.name == "select_rows_kernel"]


def adakv_kvpress_kernels(s: Shape, g: Gpu):
    """AdaKVPress's rule (adakv_rule::kvpress_safeguard): one block writes the Hkv per-head rows,
    the batched per-head select of each head's top f (f = int(0.2 (B + W)) - W, B the
    candidates per head as bench_gpu.cu passes it), then the paper rule's three kernels over the packed [Hkv (C - f)] row,
    the flatten one binary search of the f picks per element longer."""
    f = max(0, int(0.2 * (s.budget + s.window)) - s.window)
    rows = Kernel("adakv_safeguard_rows_kernel", "per-head row descriptors", 1, 256, chain_cycles=g.hbm_latency_cycles)
    per_head = per_head_select(s, g, f + s.window)
    paper = adakv_kernels(replace(s, budget=s.budget - f), g)
    flatten = replace(paper[0], chain_cycles=paper[0].chain_cycles + math.ceil(math.log2(f + 1)) * g.l2_latency_cycles,
                      times={})
    return [rows] + per_head + [flatten] + paper[1:]


def adakv_normalised_kernels(s: Shape, g: Gpu):
    """The paper rule with the per-head normalisation: each head's top B by the batched per-head
    select, one thread per head summing its top B and its C candidates in double in order (a
    chain of dependent double additions), then the paper rule's three kernels."""
    rows = Kernel("adakv_head_rows_kernel", "per-head row descriptors", 1, 256, chain_cycles=g.hbm_latency_cycles)
    per_head = per_head_select(s, g, s.budget + s.window)
    factor = Kernel("adakv_factor_kernel", "per-head sums in double, one thread each", 1, 256,
                    hbm_bytes=s.hkv * s.cand * 4, l2_bytes=s.hkv * (s.cand + s.budget) * 4,
                    chain_cycles=(s.cand + s.budget) * 4 + g.hbm_latency_cycles)
    return [rows] + per_head + [factor] + adakv_kernels(s, g)


def adakv_batch_kernels(s: Shape, g: Gpu, n):
    """AdaKV (the paper's rule) for n sequences of L/n tokens in one launch per step
    (cuda/detail/adakv_batch.cuh): the descriptors copied, every sequence's candidates flattened
    (grid chunks x n), every flattened row's global top in one selection (the wide one from
    16 Ki keys), the counts and the heads' row descriptors (a block per sequence each), then
    every head's selection in one launch."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    flat = one.hkv * one.cand
    jobs = Kernel("memcpy", "the batch's descriptors to the device (cudaMemcpyAsync)", 1, 1,
                  chain_cycles=g.hbm_latency_cycles)
    flatten = Kernel("adakv_flatten_batch_kernel", "each sequence's candidates -> its row",
                     min(ceil_div(flat, 256), 4096) * n, 256, hbm_bytes=n * flat * 4, l2_bytes=2 * n * flat * 4,
                     chain_cycles=2 * g.hbm_latency_cycles)
    if flat >= WIDE_FROM:
        top = select_wide_kernels(g, flat, n, n * one.hkv * one.budget)
    else:
        top = [replace(adakv_kernels(one, g)[1], blocks=n, times={})]
    count = Kernel("adakv_count_batch_kernel", "per-head picks -> budgets, a block per sequence", n, 256,
                   chain_cycles=2 * math.ceil(math.log2(one.hkv * one.budget + 1)) * g.l2_latency_cycles)
    prepare = Kernel("adakv_prepare_batch_kernel", "heads' kept counts, offsets, rows; a block per sequence", n, 1024,
                     chain_cycles=4 * g.hbm_latency_cycles)
    heads = per_head_select(replace(one, hkv=one.hkv * n), g, one.budget + one.window)
    return [jobs, flatten] + top + [count, prepare] + heads


def compact_batch_kernels(s: Shape, g: Gpu, n):
    """compact_batch: n sequences of L/n tokens keeping B/n per head; compact's kernels with
    the sequence as blockIdx.y (each block's work that of one sequence's call), after one
    memset and one descriptor copy."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    memset, validate, gather, scatter = compact_kernels(one, g)
    copy = Kernel("memcpy", "descriptors to the device (cudaMemcpyAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    return [memset, copy, batched(validate, n, "compact_validate_batch_kernel"),
            batched(gather, n, "compact_move_batch_kernel"), batched(scatter, n, "compact_move_batch_kernel")]


def compact_into_batch_kernels(s: Shape, g: Gpu, n):
    """compact_into_batch: the same n keep-lists copied into fresh memory in one pass (no
    staging): a memset, the descriptor copy, the source and destination checks, the copy."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    memset, validate, gather, _ = compact_kernels(one, g)
    copy = Kernel("memcpy", "descriptors to the device (cudaMemcpyAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    moved = one.hkv * one.budget * 2 * one.d * one.elem
    rows = replace(gather, name="compact_into_copy_batch_kernel", label="kept rows -> fresh rows",
                   hbm_bytes=2 * moved, l2_bytes=2 * moved + one.hkv * one.budget * 8, times={})
    return [memset, copy, batched(validate, n, "compact_into_validate_batch_kernel"),
            batched(validate, n, "compact_into_validate_batch_kernel"), batched(rows, n, "compact_into_copy_batch_kernel")]


SCOPE_CHUNK = 4096  # keys per block of magnitude_bins_kernel (cuda/scope.cuh)


def scope_kernels(s: Shape, g: Gpu, rows):
    """combine_head_scores with a normalised rule over rows [rows, L]: clear the bins, exact
    magnitude bins (shared-memory integer atomics), one thread per row converts them, then one
    thread per token folds the rows."""
    cand = s.cand
    bins = rows * 255 * 8
    memset = Kernel("memset", "clear the magnitude bins (cudaMemsetAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    per_thread = ceil_div(min(cand, SCOPE_CHUNK), 256)
    binner = Kernel("magnitude_bins_kernel", f"exact |score| sums, {rows} rows", ceil_div(cand, SCOPE_CHUNK) * rows,
                    256, hbm_bytes=rows * cand * 4, l2_bytes=bins,
                    # One shared atomic per key; attention scores crowd a few exponents, so a
                    # warp's 32 atomics mostly hit a handful of addresses and serialise (assumed
                    # 8-way on average).
                    chain_cycles=per_thread * 8 * 40 + 255 * 2 + g.hbm_latency_cycles,
                    note="shared-memory atomics on a few hot bins")
    scales = Kernel("row_scales_kernel", "bins -> 1 / exact sum per row", ceil_div(rows, 256), 256,
                    l2_bytes=bins, chain_cycles=255 * 20 + 3000 + g.l2_latency_cycles,
                    note="one thread per row: 255 bins into a 320-bit integer")
    combine = Kernel("combine_rows_kernel", "fold rows per token, in order", ceil_div(s.tokens, 256), 256,
                     hbm_bytes=rows * s.tokens * 4 + s.tokens * 4, chain_cycles=rows * g.hbm_latency_cycles / 4)
    return [memset, binner, scales, combine]


def select_shared_kernels(s: Shape, g: Gpu):
    """select over the one combined row (from 16 Ki tokens the wide selection), then its keep
    set copied to every head."""
    prep, sel = select_kernels(s, g, 1)
    if s.tokens >= WIDE_FROM:
        sel = select_wide_kernels(g, s.cand, 1, s.budget)
    else:
        sel = [sel]
    cast = Kernel("broadcast_keep_kernel", f"one keep set -> {s.hkv} heads", (s.hkv - 1) * ceil_div(s.budget, 256),
                  256, hbm_bytes=s.hkv * s.budget * 8, l2_bytes=s.budget * 8, chain_cycles=g.hbm_latency_cycles)
    return [prep] + sel + [cast]


def compressor_kernels(s: Shape, g: Gpu, n):
    """cuda::compressor's run for one SnapKV layer of n sequences of L/n tokens keeping B/n per
    head, in place: the batched scoring, the row descriptors copied and every sequence's rows
    selected in one launch (uniform budgets: counts known on the host), then the batched
    compaction (bench_gpu.cu "compressor_layer")."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    copy = Kernel("memcpy", "row descriptors and offsets to the device (cudaMemcpyAsync)", 1, 1,
                  chain_cycles=g.hbm_latency_cycles)
    _, rows = select_kernels(one, g, one.hkv * n)
    return obs_batch_kernels(s, g, n) + [copy, rows] + compact_batch_kernels(s, g, n)


def window_kernels(s: Shape, g: Gpu, name, label):
    """The chunked-prefill window (cuda/detail/prefill_window.cuh): the one-thread order check
    of a sequence's first query position against its window's newest (two dependent reads, two
    writes), and a copy of W query rows (grid W x Hq, a warp-rounded thread per channel; each
    row read and written once)."""
    order = Kernel("window_order_kernel", "the queries' order against the window's newest", 1, 1,
                   chain_cycles=3 * g.hbm_latency_cycles)
    q_bytes = s.hq * s.window * s.d * s.elem
    copy = Kernel(name, label, s.hq * s.window, min(256, ceil_div(s.d, 32) * 32), hbm_bytes=2 * q_bytes,
                  l2_bytes=2 * q_bytes, chain_cycles=2 * g.hbm_latency_cycles)
    return order, copy


def chunk_kernels(s: Shape, g: Gpu, n):
    """cuda::compressor at a prompt chunk of n sequences (chunked_prefill): the call's cancel
    word cleared, then per sequence one launch: the order check (one thread) and the chunk's
    last W rows into its layer's ring in the device state (bench_gpu.cu "compressor_chunk")."""
    memset = Kernel("memset", "the call's cancel word (cudaMemsetAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    order, append = window_kernels(s, g, "window_append_kernel", "order check + the chunk's last W rows into the ring")
    append = replace(append, chain_cycles=append.chain_cycles + order.chain_cycles)
    return [memset] + [append] * n


def compressor_chunked_kernels(s: Shape, g: Gpu, n):
    """cuda::compressor at prefill_end after a chunk, n sequences of L/n tokens: each window
    assembled from W/2 buffered rows and the call's W/2 into the workspace, the batched scoring
    (two passes: an assembled window is normalised here), the cancel word cleared and each
    sequence's order checked, compressor_kernels' selection, then the batched compaction, its
    status word started from the cancel word (bench_gpu.cu "compressor_layer_chunked", after
    its chunk call)."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    order, assemble = window_kernels(s, g, "window_assemble_kernel", "W/2 ring rows + the call's W/2 -> the window")
    memset = Kernel("memset", "the call's cancel word (cudaMemsetAsync)", 1, 1, chain_cycles=g.hbm_latency_cycles)
    copy = Kernel("memcpy", "row descriptors and offsets to the device (cudaMemcpyAsync)", 1, 1,
                  chain_cycles=g.hbm_latency_cycles)
    start = Kernel("memcpy", "the cancel word -> the compaction's status word (cudaMemcpyAsync)", 1, 1,
                   chain_cycles=g.hbm_latency_cycles)
    _, rows = select_kernels(one, g, one.hkv * n)
    cmemset, ccopy, validate, gather, scatter = compact_batch_kernels(s, g, n)
    return ([assemble] * n + obs_batch_kernels(s, g, n) + [memset] + [order] * n + [copy, rows] +
            [cmemset, ccopy, start, validate, gather, scatter])


def shared_batch_kernels(s: Shape, g: Gpu, n, select, fold):
    """Keep sets shared by heads for n sequences of L/n tokens in one launch per kernel
    (cuda/detail/shared_batch.cuh, the compressor's per-layer and per-sequence scopes, normalised
    max): the descriptors copied; the bins cleared, every sequence's heads' exact magnitude sums
    in one launch and one thread per row converting them; one kernel that combines each
    sequence's heads (and folds the row into the sequence's); with `select`, the selection block
    copied, every row selected in one launch (the wide selection from 16 Ki keys) and the sets
    copied to the other heads in one."""
    one = replace(s, tokens=s.tokens // n, budget=s.budget // n)
    rows = one.hkv * n
    jobs = Kernel("memcpy", "the batch's descriptors to the device (cudaMemcpyAsync)", 1, 1,
                  chain_cycles=g.hbm_latency_cycles)
    memset, binner, scales, _ = scope_kernels(one, g, rows)
    binner = replace(binner, name="magnitude_bins_batch_kernel", times={})
    touched = one.tokens * (12 if fold else 4)
    combine = Kernel("combine_fold_batch_kernel", f"each sequence's {one.hkv} rows per token{', folded' if fold else ''}",
                     ceil_div(one.tokens, 256) * n, 256, hbm_bytes=n * (one.hkv * one.tokens * 4 + touched),
                     chain_cycles=one.hkv * g.hbm_latency_cycles / 4 + (g.hbm_latency_cycles if fold else 0))
    kernels = [jobs, memset, binner, scales, combine]
    if not select:
        return kernels
    copy = Kernel("memcpy", "row descriptors and offsets to the device (cudaMemcpyAsync)", 1, 1,
                  chain_cycles=g.hbm_latency_cycles)
    chosen = (select_wide_kernels(g, one.cand, n, n * one.budget) if one.tokens >= WIDE_FROM
              else [select_kernels(one, g, n)[1]])
    cast = Kernel("broadcast_keep_batch_kernel", f"each set -> its {one.hkv} heads",
                  (one.hkv - 1) * ceil_div(one.budget, 256) * n, 256, hbm_bytes=n * one.hkv * one.budget * 8,
                  l2_bytes=n * one.budget * 8, chain_cycles=g.hbm_latency_cycles)
    return kernels + [copy] + chosen + [cast]


def sequence_scope_kernels(s: Shape, g: Gpu, n, last):
    """cuda::compressor under the per-sequence scope (one keep set for every layer), one SnapKV
    layer of n sequences of L/n tokens: the batched scoring, then shared_batch_kernels (the
    fold; at the last layer the selection) and, at the last layer, the compaction of every
    layer's caches (one batch per layer: the status word cleared, each layer's bitmaps cleared,
    descriptors copied and validated, then each layer's descriptors copied again and its rows
    moved)."""
    kernels = obs_batch_kernels(s, g, n) + shared_batch_kernels(s, g, n, last, True)
    if not last:
        return kernels
    memset, copy, validate, gather, scatter = compact_batch_kernels(s, g, n)
    return kernels + [memset] + [memset, copy, validate] * s.layers + [copy, gather, scatter] * s.layers


def calls(s: Shape, g: Gpu):
    """The API calls scripts/gpu-check times, each with its kernels in stream order. Keys match
    the benchmark's (bench/cuda/bench_gpu.cu)."""
    rows = s.group * s.window
    stat_tiles = ceil_div(s.tokens, OBS_TK)
    dec_tiles = ceil_div(s.tokens, DEC_TK)
    return {
        "obs_2pass": ("observation_scores, two passes",
                      [obs_tile(s, g, False), row_lse(s, g, s.hkv * rows, stat_tiles), obs_tile(s, g, True),
                       finalize(s, g, s.group)]),
        "obs_1pass": ("observation_scores, engine LSE", [obs_tile(s, g, True), finalize(s, g, s.group)]),
        "obs_state": ("observation_state (DeferKV prefill), two passes",
                      [obs_tile(s, g, False), row_lse(s, g, s.hkv * rows, stat_tiles), obs_tile(s, g, True),
                       obs_state(s, g)]),
        "decode_2pass": ("decode_observation, two passes",
                         [decode_logits(s, g, False), row_lse(s, g, s.hq, dec_tiles), decode_update(s, g)]),
        "decode_1pass": ("decode_observation, engine LSE", [decode_logits(s, g, True)]),
        "finalize_state": ("finalize_state_scores", [finalize(s, g, 1)]),
        "key_norm": ("key_norm_scores (KNorm)", [key_norm(s, g)]),
        "keydiff": ("keydiff_scores (KeyDiff)", keydiff_kernels(s, g)),
        "rerotate": ("dapq_rerotate (DapQ's re-rotated window)", [rerotate(s, g)]),
        "head_mean": ("head_mean_scores (TOVA)", [head_mean(s, g)]),
        "select_layer": (f"select, one layer ({s.hkv} rows)", select_kernels(s, g, s.hkv)),
        "select_model": (f"select, {s.layers} layers x {s.hkv} rows, one launch",
                         select_kernels(s, g, s.layers * s.hkv)),
        "compact": ("compact K and V in place", compact_kernels(s, g)),
        "obs_batch": (f"observation_scores_batch, {BATCH} sequences x {s.tokens // BATCH} tokens, two passes",
                      obs_batch_kernels(s, g, BATCH)),
        "obs_2pass_fp8": ("observation_scores, fp8 keys, bf16 queries (tensor cores), two passes",
                          [obs_tile(replace(s, elem=1), g, False),
                           row_lse(s, g, s.hkv * rows, stat_tiles), obs_tile(replace(s, elem=1), g, True),
                           finalize(s, g, s.group)]),
        "decode_plan": ("decode_plan step (graph replay), two passes",
                        [decode_logits(s, g, False), row_lse(s, g, s.hq, dec_tiles), decode_update(s, g)]),
        "adakv": ("adakv_head_budgets (device)", adakv_kernels(s, g)),
        "select_wide": (f"select_rows_wide, one row of {s.hkv} x {s.cand} keys (AdaKV's flattened layer)",
                        select_wide_kernels(g, s.hkv * s.cand, 1, s.hkv * s.budget)),
        "adakv_kvpress": ("adakv_head_budgets (device), AdaKVPress's rule", adakv_kvpress_kernels(s, g)),
        "adakv_normalised": ("adakv_head_budgets (device), the paper's rule normalised",
                             adakv_normalised_kernels(s, g)),
        "compact_batch": (f"compact_batch, {BATCH} sequences x {s.tokens // BATCH} tokens, one call",
                          compact_batch_kernels(s, g, BATCH)),
        "compact_into_batch": (f"compact_into_batch, {BATCH} sequences x {s.tokens // BATCH} tokens, one call",
                               compact_into_batch_kernels(s, g, BATCH)),
        "scope_layer": ("one keep set per layer: combine_head_scores (normalised max) + select_shared",
                        scope_kernels(s, g, s.hkv) + select_shared_kernels(s, g)),
        "compressor_layer": (f"cuda::compressor run, {BATCH} sequences x {s.tokens // BATCH} tokens (SnapKV, in place)",
                             compressor_kernels(s, g, BATCH)),
        "compressor_chunk": (f"cuda::compressor, a prompt chunk of {BATCH} sequences into their windows",
                             chunk_kernels(s, g, BATCH)),
        "compressor_layer_chunked": (f"cuda::compressor chunk + prefill_end, {BATCH} sequences x "
                                     f"{s.tokens // BATCH} tokens (SnapKV, window across the chunks)",
                                     chunk_kernels(s, g, BATCH) + compressor_chunked_kernels(s, g, BATCH)),
        "compressor_layer_adakv": (f"cuda::compressor run, {BATCH} sequences x {s.tokens // BATCH} tokens, AdaKV "
                                   "heads (SnapKV, in place)",
                                   obs_batch_kernels(s, g, BATCH) + adakv_batch_kernels(s, g, BATCH) +
                                   compact_batch_kernels(s, g, BATCH)),
        "compressor_layer_scope": (f"cuda::compressor run, {BATCH} sequences x {s.tokens // BATCH} tokens, one keep "
                                   "set per layer (SnapKV, normalised max, in place)",
                                   obs_batch_kernels(s, g, BATCH) + shared_batch_kernels(s, g, BATCH, True, False) +
                                   compact_batch_kernels(s, g, BATCH)),
        "sequence_scope_fold": (f"per-sequence scope, a layer before the last: {BATCH} sequences folded",
                                sequence_scope_kernels(s, g, BATCH, False)),
        "sequence_scope_last": (f"per-sequence scope, the last layer: {BATCH} sequences, {s.layers} layers compacted",
                                sequence_scope_kernels(s, g, BATCH, True)),
        "sequence_scope_step": (f"per-sequence scope, one step of every layer: {s.layers - 1} folds, then the last",
                                sequence_scope_kernels(s, g, BATCH, False) * (s.layers - 1) +
                                sequence_scope_kernels(s, g, BATCH, True)),
    }


def call_time(kernels, g: Gpu):
    return sum(k.bound(g)[0] for k in kernels)


def target_bounds(s: Shape, g: Gpu):
    """What the GPU redesign is bounded by at this shape: scoring on tensor cores (K read
    once per pass, MMA and exponentials overlapped), decode at HBM bandwidth."""
    k = s.hkv * s.tokens * s.d * s.elem
    mma = 2.0 * s.hq * s.window * s.tokens * s.d
    exps = s.hq * s.window * s.tokens
    per_pass = max(k / (g.hbm_gbs * 1e9), mma / (g.tensor_bf16_tflops * 1e12),
                   exps / (g.sms * g.mufu_per_clk * g.clock_ghz * 1e9)) * 1e6
    decode = (k + 2 * s.hkv * s.cand * 4) / (g.hbm_gbs * 1e9) * 1e6
    return {"scoring_pass_us": per_pass, "scoring_2pass_us": 2 * per_pass + 2 * g.launch_us,
            "scoring_1pass_us": per_pass + g.launch_us, "decode_us": max(decode, g.launch_us),
            "decode_70pct_us": max(decode / 0.7, g.launch_us),
            "mma_us": mma / (g.tensor_bf16_tflops * 1e12) * 1e6,
            "exp_us": exps / (g.sms * g.mufu_per_clk * g.clock_ghz * 1e9) * 1e6}


# ---- the PyTorch kvpress pipeline -----------------------------------------------------------

def kvpress_ops(s: Shape):
    """(op, HBM bytes, kernels) of kvpress' SnapKVPress.score + ScorerPress.compress as
    bench/torch_pipeline.py's kvpress_snapkv runs them (bf16 model dtype)."""
    e, G = s.elem, s.group
    k = s.hkv * s.tokens * s.d * e
    rep = s.hq * s.tokens * s.d * e
    attn = s.hq * s.window * s.tokens * e          # [1, Hq, W, L] in the model dtype
    attn32 = attn * 4 // e
    small = s.hq * s.tokens * e
    return [
        ("repeat_kv (expand + reshape copy)", k + rep, 1),
        ("matmul Q K^T (bf16 tensor cores; reads the repeated K)", rep + attn + s.hq * s.window * s.d * e, 1),
        ("/ sqrt(d)", 2 * attn, 1),
        ("ones_like * -inf, triu (mask)", attn + 2 * attn + 2 * attn, 3),
        ("attn += mask", 3 * attn, 1),
        ("softmax(float32)", attn + attn32, 1),
        (".to(bf16)", attn32 + attn, 1),
        ("mean over the window", attn + small, 1),
        ("avg_pool1d, GQA mean, pad (max().item(): a host sync)", 4 * small, 5),
        ("topk", s.hkv * s.tokens * e + s.hkv * s.budget * 8, 2),
        ("gather K and V", 4 * s.hkv * s.budget * s.d * e, 2),
    ], G


def kvpress_time(s: Shape, g: Gpu):
    ops, _ = kvpress_ops(s)
    rows = []
    for name, nbytes, launches in ops:
        t = max(nbytes / (g.hbm_gbs * 1e9) * 1e6, launches * g.launch_us)
        rows.append((name, nbytes, launches, t))
    sync = 2 * g.launch_us  # the .item() drains the queue: the next launches start cold
    return rows, sum(r[3] for r in rows) + sync, sync


# ---- output ---------------------------------------------------------------------------------

def fmt_bytes(b):
    if b == 0:
        return "0"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.1f} {unit}"
    return f"{b:.0f} B"


def fmt_us(t):
    return f"{t:.1f}" if t < 100 else f"{t:.0f}"


def shape_line(s: Shape):
    return (f"Hq={s.hq} Hkv={s.hkv} d={s.d} L={s.tokens} W={s.window} B={s.budget}, "
            f"{'bf16' if s.elem == 2 else 'fp32'} K/V")


def table(s: Shape, g: Gpu, out):
    out.append(f"Shape: {shape_line(s)}. GPU: {g.name}, {g.sms} SMs at {g.clock_ghz} GHz, HBM "
               f"{g.hbm_gbs / 1000:.1f} TB/s, FP32 {g.fp32_tflops:.1f} TFLOP/s, launch floor {g.launch_us} us.")
    out.append("")
    out.append("| call / kernel | grid x threads | HBM | L2 | FLOP FP32 / tensor | smem wavefronts | time HBM / FP32 / "
               "tensor / SMEM / latency (us) | bound | modelled (us) |")
    out.append("|---|---:|---:|---:|---:|---:|---|---|---:|")
    for key, (title, ks) in calls(s, g).items():
        total = call_time(ks, g)
        out.append(f"| **{title}** (`{key}`), {len(ks)} launches | | | | | | | | **{fmt_us(total)}** |")
        # A kernel launched several times (per sequence, per layer) is one row: its count and
        # the launches' total time.
        counts = {}
        for k in ks:
            counts.setdefault(id(k), [k, 0])[1] += 1
        for k, count in counts.values():
            t, res = k.bound(g)
            t *= count
            tt = k.times
            mio_total = k.mio_per_block * k.blocks
            times = f" (x {count})" if count > 1 else ""
            out.append(f"| &nbsp; {k.name}{times}: {k.label} | {k.blocks} x {k.threads} | {fmt_bytes(k.hbm_bytes)} | "
                       f"{fmt_bytes(k.l2_bytes)} | {k.fp32_flops / 1e9:.2f} / {k.tensor_flops / 1e9:.2f} G | "
                       f"{mio_total / 1e6:.2f} M | {fmt_us(tt['HBM'])} / {fmt_us(tt['FP32'])} / {fmt_us(tt['tensor'])} / "
                       f"{fmt_us(tt['SMEM'])} / {fmt_us(tt['latency'])} "
                       f"| {res} | {fmt_us(t)} |")
    out.append("")


def call_summary(shapes, g: Gpu, out):
    out.append("| call (launches) | " + " | ".join(f"L={s.tokens}, W={s.window}" for s in shapes) + " |")
    out.append("|---|" + "---:|" * len(shapes))
    per_shape = [calls(s, g) for s in shapes]
    for key, (title, ks) in per_shape[0].items():
        cells = []
        for c in per_shape:
            kk = c[key][1]
            slowest = max(kk, key=lambda k: k.bound(g)[0])
            cells.append(f"{fmt_us(call_time(kk, g))} us ({slowest.bound(g)[1]})")
        out.append(f"| {title} (`{key}`, {len(ks)}) | " + " | ".join(cells) + " |")
    out.append("")


def layer_summary(shapes, g: Gpu, out):
    out.append("| shape | kvevict today: scoring + select + compact (launches) | same, engine LSE | "
               "of which select + compact | scoring at the issue-16 target bound (2 passes) | "
               "PyTorch kvpress pipeline (model) |")
    out.append("|---|---:|---:|---:|---:|---:|")
    for s in shapes:
        c = calls(s, g)
        sel, comp = c["select_layer"][1], c["compact"][1]
        two = c["obs_2pass"][1] + sel + comp
        one = c["obs_1pass"][1] + sel + comp
        tb = target_bounds(s, g)
        _, torch_t, _ = kvpress_time(s, g)
        out.append(f"| L={s.tokens}, W={s.window} | {fmt_us(call_time(two, g))} us ({len(two)}) | "
                   f"{fmt_us(call_time(one, g))} us ({len(one)}) | {fmt_us(call_time(sel + comp, g))} us | "
                   f"{fmt_us(tb['scoring_2pass_us'])} us | {fmt_us(torch_t)} us |")
    out.append("")


def torch_table(s: Shape, g: Gpu, out):
    rows, total, sync = kvpress_time(s, g)
    out.append(f"PyTorch kvpress pipeline, {shape_line(s)} (HBM bytes at {g.hbm_gbs / 1000:.1f} TB/s, "
               f"each kernel at least {g.launch_us} us):")
    out.append("")
    out.append("| op | HBM bytes | kernels | modelled (us) |")
    out.append("|---|---:|---:|---:|")
    for name, nbytes, launches, t in rows:
        out.append(f"| {name} | {fmt_bytes(nbytes)} | {launches} | {fmt_us(t)} |")
    out.append(f"| host sync of `.item()` (queue drained, next launches cold) | | | {fmt_us(sync)} |")
    out.append(f"| **total** | {fmt_bytes(sum(r[1] for r in rows))} | {sum(r[2] for r in rows)} | "
               f"**{fmt_us(total)}** |")
    out.append("")


DOC_SHAPES = [Shape(tokens=4096, window=32), Shape(tokens=32768, window=32), Shape(tokens=32768, window=64)]


def cmd_docs(g: Gpu):
    out = []
    table(DOC_SHAPES[1], g, out)
    out.append("Every call at the three shapes (modelled time, and the binding resource of its slowest kernel):")
    out.append("")
    call_summary(DOC_SHAPES, g, out)
    out.append("Per layer (one sequence, prefill compression):")
    out.append("")
    layer_summary(DOC_SHAPES, g, out)
    torch_table(DOC_SHAPES[1], g, out)
    tb = target_bounds(DOC_SHAPES[1], g)
    out.append(f"Target bounds at L=32768, W=32: one scoring pass {tb['scoring_pass_us']:.1f} us (K read once; "
               f"MMA {tb['mma_us']:.1f} us, exponentials {tb['exp_us']:.1f} us overlapped); decode step "
               f"{tb['decode_us']:.1f} us at the HBM bound, {tb['decode_70pct_us']:.1f} us at 70%.")
    print("\n".join(out))


# ---- compare (scripts/gpu-check) ------------------------------------------------------------

def parse_bench(path):
    """'@@ key value' and '@@k call index name us' lines of one benchmark run."""
    vals, kern = {}, {}
    with open(path) as f:
        for line in f:
            p = line.split()
            if len(p) == 3 and p[0] == "@@":
                try:
                    vals[p[1]] = float(p[2])
                except ValueError:
                    pass
            elif len(p) == 5 and p[0] == "@@k":
                kern.setdefault(p[1], []).append((int(p[2]), p[3], float(p[4])))
    for v in kern.values():
        v.sort()
    return vals, kern


def device_gpu(vals, base: Gpu):
    """The peak table with the measured device's SM count, SM clock and HBM peak."""
    g = base
    if vals.get("sm_count"):
        g = replace(g, sms=int(vals["sm_count"]))
    if vals.get("sm_clock_mhz"):
        g = replace(g, clock_ghz=vals["sm_clock_mhz"] / 1000)
    if vals.get("peak_gbs"):
        g = replace(g, hbm_gbs=vals["peak_gbs"])
    if "sm_count" in vals or "peak_gbs" in vals:
        g = replace(g, name=f"this device ({g.sms} SMs, {g.clock_ghz:.2f} GHz, HBM {g.hbm_gbs:.0f} GB/s)")
    return g


def compare(bench_paths, torch_paths, base: Gpu):
    out, problems = [], []
    for i, path in enumerate(bench_paths):
        vals, kern = parse_bench(path)
        if "tokens" not in vals:
            out.append(f"{path}: no '@@ tokens' line (benchmark did not run?)")
            problems.append(path)
            continue
        s = Shape(tokens=int(vals["tokens"]), window=int(vals.get("window", 32)), hq=int(vals.get("hq", 32)),
                  hkv=int(vals.get("hkv", 8)), d=int(vals.get("d", 128)), budget=int(vals.get("budget", 2048)))
        g = device_gpu(vals, base)
        out.append(f"#### {shape_line(s)}")
        out.append("")
        out.append(f"Model peaks: {g.name}; launch floor {g.launch_us} us. Calls (timed from the host, "
                   "launches included): achieved = modelled / measured. Kernels (timed alone in a graph, no "
                   "host launch): achieved = the kernel's device bound (its work on the binding resource, "
                   "no launch floor) / measured; 1.00 = at the bound.")
        out.append("")
        out.append("| call / kernel | measured (us) | modelled (us) | device bound (us) | binding resource | "
                   "achieved |")
        out.append("|---|---:|---:|---:|---|---:|")
        for key, (title, ks) in calls(s, g).items():
            total = call_time(ks, g)
            meas = vals.get(key + "_us")
            out.append(f"| **{title}** | {fmt_us(meas) if meas else 'n/a'} | {fmt_us(total)} | | | "
                       f"{f'{total / meas:.2f}' if meas else 'n/a'} |")
            got = kern.get(key, [])
            if any(x[1] == "capture_failed" for x in got):
                problems.append(f"{key}: the benchmark could not capture the call into a graph")
                got = []
            if got and len(got) != len(ks):
                problems.append(f"{key}: the model has {len(ks)} kernels, the call launched {len(got)}")
            for j, k in enumerate(ks):
                t, res = k.bound(g)
                m = next((x for x in got if x[0] == j), None)
                if m and m[1] not in ("kernel", "other") and k.name not in m[1]:  # "kernel": name unknown
                    problems.append(f"{key}[{j}]: the model expects {k.name}, the call launched {m[1]}")
                mt = m[2] if m else None
                dt, dres = k.device_bound(g)
                ok = mt is not None and mt > 0
                out.append(f"| &nbsp; {k.name} ({k.label}) | {fmt_us(mt) if ok else 'n/a'} | {fmt_us(t)} | "
                           f"{fmt_us(dt)} | {dres} | {f'{dt / mt:.2f}' if ok else 'n/a'} |")
        if i < len(torch_paths):
            tv, _ = parse_bench(torch_paths[i])
            rows, ttotal, _ = kvpress_time(s, g)
            meas = tv.get("torch_kvpress_us")
            out.append(f"| **PyTorch kvpress pipeline** (bench/torch_pipeline.py's kvpress_snapkv) | "
                       f"{fmt_us(meas) if meas else 'n/a'} | {fmt_us(ttotal)} | | HBM | "
                       f"{f'{ttotal / meas:.2f}' if meas else 'n/a'} |")
            for key, title in (("torch_topk_layer_us", f"torch.topk, {s.hkv} rows (vs select_layer)"),
                               ("torch_topk_model_us", f"torch.topk, {s.layers * s.hkv} rows (vs select_model)")):
                if key in tv:
                    out.append(f"| {title}, not modelled | {fmt_us(tv[key])} | | | | |")
        out.append("")
    if problems:
        out.append("Model out of date with the kernels (update scripts/gpu-model.py):")
        out.extend(f"- {p}" for p in problems)
    print("\n".join(out))
    return 1 if problems else 0


# ---- self-test ------------------------------------------------------------------------------

DOC_BEGIN = "<!-- gpu-model.py docs: begin -->"
DOC_END = "<!-- gpu-model.py docs: end -->"


def self_test():
    import contextlib
    import io
    import os
    import tempfile
    g = GPUS["h200"]
    s = Shape()
    fails = []

    def check(cond, what):
        if not cond:
            fails.append(what)

    def close(a, b, rel=1e-6):
        return abs(a - b) <= rel * max(abs(a), abs(b))

    check(close(g.fp32_tflops, 66.9, 1e-2), f"H200 FP32 peak {g.fp32_tflops}")
    c = calls(s, g)
    stats, lse, acc, fin = c["obs_2pass"][1]
    # K of a Llama-3.1-8B layer at 32K: 8 * 32768 * 128 * 2 B = 64 MiB, read once per pass.
    check(stats.hbm_bytes - 64 * 2**20 == 8 * 32 * 4 * 512 * 8, f"stats HBM bytes {stats.hbm_bytes}")
    # Logits FLOPs per pass: 2 * Hq * W * L * d = 8.59 GFLOP (no row or key padding at this
    # shape), on tensor cores for bf16.
    check(stats.tensor_flops == 2.0 * 32 * 32 * 32768 * 128 and stats.fp32_flops == 0, f"stats FLOPs {stats.tensor_flops}")
    # Tensor cores: 12 conflict-free fragment loads per 4 MMAs per 16 channels, plus the logits'
    # round trip through the scratch tile (16 STS, 4-way conflicted: row g and column 2t fall in
    # bank g + 2t; 16 LDS, 2-way).
    check(mma_tile_wavefronts(128) == 8 * 12 + 16 * 4 + 16 * 2, f"mma wavefronts {mma_tile_wavefronts(128)}")
    check(stats.bound(g)[1] == "SMEM" and acc.bound(g)[1] == "SMEM", "scoring passes bound by shared memory")
    check(50 < stats.bound(g)[0] < 80, f"stats at 32K: {stats.bound(g)[0]} us")
    # float32 keys stay on FP32 cores: 8 LDS per 16 FFMA at 1 LDS and 4 FFMA per clock per SM,
    # so the shared-memory bound is twice the FP32 bound.
    f32 = calls(Shape(elem=4), g)["obs_2pass"][1][0]
    check(f32.fp32_flops == 2.0 * 32 * 32 * 32768 * 128 and f32.tensor_flops == 0, f"f32 FLOPs {f32.fp32_flops}")
    t = f32.evaluate(g)
    check(t["SMEM"] > 1.9 * t["FP32"] and t["SMEM"] < 2.2 * t["FP32"], f"f32 stats SMEM/FP32 {t['SMEM'] / t['FP32']}")
    check(lse.bound(g)[1] == "launch" and fin.bound(g)[1] == "launch", "row LSE and finalize at the launch floor")
    # Occupancy: 6 blocks per SM for both passes (40 registers; 35 and 36 KiB of shared memory).
    check(stats.resident(g) == 6 and acc.resident(g) == 6, f"resident {stats.resident(g)} {acc.resident(g)}")
    # Bank model: 16 lanes 32 B apart reading 4 B each: 4 lanes per bank, 4 wavefronts.
    check(wavefronts([(lane * 32, 4) for lane in range(16)]) == 4, "4-way conflict")
    check(wavefronts([(lane * 4, 4) for lane in range(32)]) == 1, "conflict-free")
    check(wavefronts([(0, 4)] * 32) == 1, "broadcast")
    check(wavefronts([(lane * 16, 16) for lane in range(32)]) == 4, "LDS.128 of 512 B")
    # Decode: the transpose-reduce of 16 values (G = 4, 4 keys) takes 8 + 4 + 2 + 1 shuffles,
    # of 4 values 2 + 1 + 1 + 1, of 32 values 16 + 8 + 4 + 2.
    check(transpose_reduce_shuffles(16) == 15 and transpose_reduce_shuffles(4) == 5, "transpose-reduce 16, 4")
    check(transpose_reduce_shuffles(32) == 30 and transpose_reduce_shuffles(8) == 8, "transpose-reduce 32, 8")
    check(decode_query_wavefronts(2) == 4 and decode_query_wavefronts(4) == 4, "decode query reload: 2 x 2 wavefronts")
    # The decode step streams K at >= 70% of HBM at L >= 32K for G = 1 .. 8 (issue 16), 16-bit
    # and float keys, d = 128 (queries in registers) and 256 (reloaded per panel); fp8 keys at
    # G <= 4. (G > 8 and fp8 at G > 4 model lower: docs/cuda.md says which resource binds.)
    # The per-bucket registers set the occupancy: bucket 8 fits one block per SM.
    check(decode_logits(replace(s, hq=64), g, True).resident(g) == 1 and
          decode_logits(s, g, True).resident(g) == 2, "decode blocks per SM by bucket")
    for shape in (s, replace(s, hq=8), replace(s, hq=16), replace(s, hq=40), replace(s, hq=64), replace(s, d=256),
                  replace(s, tokens=131072), replace(s, elem=4), replace(s, elem=4, hq=64), replace(s, elem=1)):
        for one in (True, False):
            dec = decode_logits(shape, g, one)
            kb = shape.hkv * shape.tokens * shape.d * shape.elem
            frac = (kb / (g.hbm_gbs * 1e9) * 1e6) / dec.bound(g)[0]
            check(frac >= 0.7,
                  f"decode G={shape.group} d={shape.d} elem={shape.elem} at {frac:.2f} of HBM, {dec.bound(g)[1]}")
    # Launch counts the issue quotes: 9 kernels + 1 memset per (sequence, layer) with two passes.
    n = len(c["obs_2pass"][1]) + len(c["select_layer"][1]) + len(c["compact"][1])
    check(n == 10, f"launches per layer {n}")
    check(c["select_layer"][1][1].bound(g)[1] == "latency", "select is latency-bound")
    # Longer prompts never take less time.
    small = calls(Shape(tokens=4096), g)
    for key in c:
        check(call_time(small[key][1], g) <= call_time(c[key][1], g), f"{key} not monotone in L")
    # The kvpress model: repeat_kv writes Hq * L * d * 2 = 256 MiB at 32K.
    ops, _ = kvpress_ops(s)
    check(ops[0][1] == 64 * 2**20 + 256 * 2**20, f"repeat_kv bytes {ops[0][1]}")
    # compare: a synthetic benchmark at exactly the modelled times is at 1.00; a kernel list
    # that differs from the model is reported.
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.txt")
        with open(path, "w") as f:
            f.write("@@ tokens 32768\n@@ window 32\n@@ sm_count 132\n@@ sm_clock_mhz 1980\n@@ peak_gbs 4800\n")
            for key, (_, ks) in c.items():
                f.write(f"@@ {key}_us {call_time(ks, g):.6f}\n")
                for j, k in enumerate(ks):
                    f.write(f"@@k {key} {j} {k.name} {k.device_bound(g)[0]:.6f}\n")
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = compare([path], [], g)
        text = buf.getvalue()
        rows = sum(1 + len(ks) for _, ks in c.values())
        check(rc == 0 and text.count("| 1.00 |") == rows and "n/a" not in text, "compare at the model")
        with open(path, "a") as f:
            f.write("@@k decode_1pass 1 decode_update_kernel 3.0\n")
        with contextlib.redirect_stdout(io.StringIO()):
            check(compare([path], [], g) == 1, "compare flags a kernel list that differs from the model")
    # docs/cuda.md carries the tables `docs` prints; they must be the model's current output.
    doc = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "cuda.md")
    if os.path.exists(doc):
        text = open(doc).read()
        begin, end = text.find(DOC_BEGIN), text.find(DOC_END)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            cmd_docs(g)
        check(begin >= 0 and end > begin and text[begin + len(DOC_BEGIN):end].strip() == buf.getvalue().strip(),
              "docs/cuda.md's model tables differ from `gpu-model.py docs` (paste its output between the markers)")
    for f in fails:
        print("FAIL:", f)
    print(f"gpu-model self-test: {'FAILED' if fails else 'passed'} ({len(fails)} failures)")
    return 1 if fails else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["table", "docs", "compare", "self-test"])
    ap.add_argument("files", nargs="*", help="compare: BENCH.txt [TORCH.txt], or --bench/--torch lists")
    ap.add_argument("--bench", action="append", default=[])
    ap.add_argument("--torch", action="append", default=[])
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h200")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--launch-us", type=float)
    args = ap.parse_args()
    g = GPUS[args.gpu]
    if args.launch_us is not None:
        g = replace(g, launch_us=args.launch_us)
    if args.command == "self-test":
        return self_test()
    if args.command == "docs":
        cmd_docs(g)
        return 0
    if args.command == "table":
        out = []
        s = Shape(tokens=args.tokens, window=args.window)
        table(s, g, out)
        torch_table(s, g, out)
        print("\n".join(out))
        return 0
    bench = args.bench + args.files[:1]
    torch = args.torch + args.files[1:2]
    if not bench:
        ap.error("compare needs a benchmark output")
    return compare(bench, torch, g)


if __name__ == "__main__":
    sys.exit(main())
