#!/usr/bin/env bash
# Retrains TinyLM exactly as the committed weights were trained (TRAINING.md): three runs of
# train.py chained through checkpoints. Writes examples/tinylm/weights/tinylm.safetensors
# (the committed file: commit the new one only on purpose) and keeps checkpoints in $WORK.
# Results match ours up to floating-point summation order (OpenBLAS threads).
# Usage: examples/tinylm/train/reproduce.sh            (from anywhere; about 75 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${WORK:-/tmp/tinylm-train}
mkdir -p "$WORK"
py=/usr/bin/python3
train=examples/tinylm/train/train.py

# Stage 1: context curriculum 32 -> 512 tokens at a constant learning rate (3e-3 after a
# 100-step warm-up). 2300 steps.
$py $train --seed 1234 --threads 1 --phases 32:32:1000,64:32:400,128:16:300,256:8:300,512:4:300 \
  --decay_steps 0 --ckpt "$WORK/stage1.pt" --out "$WORK/stage1.safetensors" | tee "$WORK/stage1.log"

# Stage 2: 1024-token contexts, fresh AdamW, the first half of an 800-step cosine decay.
$py $train --seed 1234 --threads 2 --init "$WORK/stage1.pt" --phases 1024:2:400 --schedule_steps 800 \
  --warmup 20 --decay_steps 800 --ckpt "$WORK/stage2.pt" --out "$WORK/stage2.safetensors" | tee "$WORK/stage2.log"

# Stage 3: 1024-token contexts, new data (seed 1235), a 400-step cosine decay from 1.6e-3.
$py $train --seed 1235 --threads 1 --init "$WORK/stage2.pt" --phases 1024:2:400 --lr 1.6e-3 \
  --warmup 20 --decay_steps 400 --ckpt "$WORK/stage3.pt" --out examples/tinylm/weights/tinylm.safetensors \
  | tee "$WORK/stage3.log"

# The reference logits the C++ engine is checked against, and full-KV accuracy.
(cd examples/tinylm/train && $py make_data.py)
$py examples/tinylm/train/eval.py
