#!/usr/bin/env bash
# The suite's CUDA tests and every GPU row of the project in one call (about 8-10 minutes on one
# GPU, not yet timed whole), in this order: the CUDA tests; issue 32's rows, which no card has
# measured yet (the Triton lattice filter against torch's, the training step CE vs MARS with the
# CRF teacher and its profile, `mars debias` and `mars crf` at --io-workers 0 and 4, `mars predict`
# fp32/bf16/NHWC, `mars features` 1 vs 8 images per call, the whole pipeline `mars reproduce
# --train` of 32 synthetic 500x375 images with each stage's seconds per image, the I/O side on the
# host's cores); then the rows measured on an H100 on 2026-11-27 (the dense CRF at batch 1/16/64,
# the pydensecrf drop-in on CUDA, the blur's gather forms). The rows are written as they come, so
# a call cut short by its time limit still returns the first sections; `--sections a,b` (after
# OUT_FILE) runs some. On a machine without a GPU it says so and exits 0.
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
