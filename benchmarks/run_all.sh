#!/usr/bin/env bash
# Run every benchmark with its default or given sizes and keep the printed tables.
# Usage: bash benchmarks/run_all.sh [OUT_DIR]   (QUICK=1 for smaller sizes)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-benchmarks/results}
mkdir -p "$out"
if [ "${QUICK:-0}" = 1 ]; then
  sel="--sizes 500,2000 --dims 70 --baseline-max 2000"; deb="--images 32"; step="--steps 3"; ref="--repeats 1"
else
  sel=""; deb=""; step="--crf"; ref=""
fi
python3 benchmarks/bench_kmeans.py | tee "$out/bench_kmeans.txt"
python3 benchmarks/bench_select.py --backends compiled,torch $sel | tee "$out/bench_select.txt"
python3 benchmarks/bench_debias.py $deb | tee "$out/bench_debias.txt"
python3 benchmarks/bench_train_step.py $step | tee "$out/bench_train_step.txt"
python3 benchmarks/bench_teacher_refine.py $ref | tee "$out/bench_teacher_refine.txt"
if [ -f benchmarks/bench_adapters.py ]; then
  python3 benchmarks/bench_adapters.py | tee "$out/bench_adapters.txt"
fi
