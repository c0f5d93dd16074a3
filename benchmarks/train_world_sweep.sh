#!/usr/bin/env bash
# MARS vs CE on the demo world over settings and seeds, every (setting, seed) a process of its
# own on one device (a GPU runs a dozen of these small networks at once): the numbers behind the
# README's demo-world paragraph. Prints each process's rows, then a summary.
# Usage: bash benchmarks/train_world_sweep.sh OUT_DIR [DEVICE] [SEEDS] [SETTINGS_FILE]
#   DEVICE: cuda (default) or cpu; SEEDS: "0 1 2" (default); SETTINGS_FILE: lines as SETTINGS below
#   (a tag, then bench_train_world.py flags), instead of SETTINGS.
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/_package_path.sh
out=${1:?usage: train_world_sweep.sh OUT_DIR [DEVICE] [SEEDS]}
device=${2:-cuda}
seeds=${3:-0 1 2}
mkdir -p "$out"
SETTINGS=(
  "a300   --size 64 --iterations 300  --lr 3e-4 --ema 0.99"
  "b300   --size 64 --iterations 300  --lr 1e-3 --ema 0.99"
  "c1000  --size 64 --iterations 1000 --lr 3e-4 --ema 0.99"
  "d1000  --size 64 --iterations 1000 --lr 3e-4 --ema 0.999"
  "e3000  --size 64 --iterations 3000 --lr 3e-4 --ema 0.999"
  "f300   --size 48 --iterations 300  --lr 3e-4 --ema 0.99"
)
if [ -n "${4:-}" ]; then mapfile -t SETTINGS < "$4"; fi
for line in "${SETTINGS[@]}"; do  # each setting's world, written once before its processes share it
  set -- $line; tag=$1; shift
  python3 benchmarks/bench_train_world.py "$@" --data "$out/world_$tag" --prepare-only || exit 1
done
pids=()
for line in "${SETTINGS[@]}"; do
  set -- $line; tag=$1; shift
  for seed in $seeds; do
    python3 benchmarks/bench_train_world.py "$@" --seeds $seed --device "$device" --threads 1 \
      --data "$out/world_$tag" --tag "_$tag" --json "$out/$tag-s$seed.json" > "$out/$tag-s$seed.log" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p"; done
python3 - "$out" <<'PY'
import json, sys, glob, collections
rows = collections.defaultdict(list)
for f in sorted(glob.glob(f"{sys.argv[1]}/*-s*.json")):
    tag = f.split("/")[-1].split("-s")[0]
    for r in json.load(open(f))["rows"]:
        rows[(tag, r["eval"], r["loss"])].append(r)
print("| setting | eval | run | seeds | boat | train | mIoU | train s |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for (tag, ev, loss), rs in sorted(rows.items()):
    m = lambda k: sum(r["iou"][k] for r in rs) / len(rs)
    print(f"| {tag} | {ev} | {loss} | {len(rs)} | {m('boat'):.1f} | {m('train'):.1f} | "
          f"{sum(r['miou'] for r in rs) / len(rs):.1f} | {sum(r['train_s'] for r in rs) / len(rs):.0f} |")
    print("|  |  |  | per seed | " + " ".join(f"{r['iou']['boat']:.1f}" for r in rs) + " | "
          + " ".join(f"{r['iou']['train']:.1f}" for r in rs) + " | | |")
PY
