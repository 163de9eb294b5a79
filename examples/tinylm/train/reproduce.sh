#!/usr/bin/env bash
# Retrains TinyLM exactly as the committed weights were trained (TRAINING.md): three runs of
# train.py chained through checkpoints. Writes examples/tinylm/weights/tinylm.safetensors
# (the committed file: commit the new one only on purpose) and keeps checkpoints in $WORK.
# Results match ours up to floating-point summation order (OpenBLAS threads).
# Usage: examples/tinylm/train/reproduce.sh            (from anywhere; about 75 min on 2 cores)
#        examples/tinylm/train/reproduce.sh fid2       the 4-layer Fidelity-2 model from its start
#        examples/tinylm/train/reproduce.sh fid2-resume  continue the committed 4-layer checkpoint
# (TRAINING.md, "Fidelity-2 model (4 layers)"; ~2 h on one thread, needs libopenblas0-pthread)
set -euo pipefail
cd "$(dirname "$0")/../../.."
WORK=${WORK:-/tmp/tinylm-train}
mkdir -p "$WORK"
py=/usr/bin/python3
train=examples/tinylm/train/train.py

two_layer() {
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
}

# Fidelity 2: the 4-layer model, warm-started from the committed 2-layer weights, one resumable
# schedule (checkpoint + safetensors export every 50 steps). From scratch this writes into $WORK
# (set FID2_CKPT / FID2_OUT to the committed paths to replace them on purpose).
fid2() {
  $py $train --seed 1234 --threads 1 --n_layers 4 --warm_from examples/tinylm/weights/tinylm.safetensors \
    --phases 128:16:400,256:8:500,512:4:700,1024:2:1800 \
    --tasks single:1,multikey:1,multivalue:2,vartrack:2,longneedle:1.5,gather:2,longchain:2,listall:1.5 \
    --lr 1.5e-3 --warmup 100 --decay_steps 2000 --attn_sup 1.0 --attn_sup_hold 0.35 --attn_sup_zero 0.65 \
    --log_every 25 --ckpt_every 50 --ckpt "${FID2_CKPT:-$WORK/fid2-checkpoint.pt}" \
    --out "${FID2_OUT:-$WORK/tinylm4.safetensors}" | tee "$WORK/fid2.log"
}

# Continue the committed 4-layer checkpoint in place (same schedule and data stream; it keeps
# writing examples/tinylm/weights/fid2/checkpoint.pt and weights/tinylm4.safetensors).
fid2_resume() {
  $py $train --threads 1 --resume "${FID2_CKPT:-examples/tinylm/weights/fid2/checkpoint.pt}" | tee -a "$WORK/fid2.log"
}

case "${1:-two-layer}" in
  two-layer) two_layer ;;
  fid2) fid2 ;;
  fid2-resume) fid2_resume ;;
  *) echo "usage: $0 [two-layer|fid2|fid2-resume]" >&2; exit 2 ;;
esac
