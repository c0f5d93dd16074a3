#!/usr/bin/env bash
# Every GPU row of the project in one short call (under 8 minutes on one GPU): the dense CRF at
# batch 1/16/64 (500x375, 2 and 21 labels, both presets), the pydensecrf drop-in on CUDA (21 and 81
# labels, deeplab-pytorch's and IRNet's settings), the blur's gather forms, the lattice filter
# torch vs Triton (16 x 512x512, 4 and 21 labels; the dense CRF both ways), `mars crf` (21 and 81
# labels, COCO val extrapolated), `mars debias --device cuda`, the
# training step CE vs MARS with the CRF teacher (batch 16 x 512 x 512) and its profile, `mars features`
# fp32/fp16 (one image; fp16 also 1 vs 8 images per call, with TFLOP/s), `mars predict`, and the
# whole pipeline (section `reproduce`, benchmarks/bench_pipeline.py: `mars reproduce --train` of 32
# synthetic 500x375 images end to end, seconds per image of each stage). On a machine without a
# GPU it says so and exits 0.
# Usage: bash benchmarks/gpu.sh [OUT_FILE]   (the rows also go to OUT_FILE, default $OUT/gpu_rows.md
# when $OUT is set); record them in docs/benchmarks.md with the card's name.
set -uo pipefail
cd "$(dirname "$0")/.."
# The package without installing it (a bare GPU machine has torch but not this checkout).
source benchmarks/_package_path.sh
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"; then
  echo "gpu.sh: no GPU on this machine (torch.cuda.is_available() is False): no GPU row to measure"
  exit 0
fi
out=${1:-${OUT:+$OUT/gpu_rows.md}}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
if [ -n "$out" ]; then
  python3 benchmarks/bench_gpu.py "${@:2}" 2>&1 | tee "$out"
else
  python3 benchmarks/bench_gpu.py 2>&1
fi
