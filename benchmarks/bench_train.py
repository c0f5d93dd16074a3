"""Seconds per step and peak memory of `mars train` (the real program: data loading, augmentation,
AMP on CUDA, checkpoint skipped), plain CE vs MARS (EMA teacher + complement + WCE) with the
teacher refined by the dense CRF on the device (the paper's) and without refinement.

A folder of --images generated 500x375 photograph-like images (bench_crf.natural_image) with
labels of a few ellipse-shaped objects and, for MARS, a quarter of each object's pixels marked
biased (254) is trained for --steps steps; s/step is the median of the per-step times after
--warmup steps, read from the run's log.jsonl. Random initialisation (no --weights): the work
per step is the same as with ImageNet weights.

    python benchmarks/bench_train.py [--arch deeplabv3+ --backbone resnet101 --batch 16 --crop 512]
                                     [--steps 8 --warmup 3] [--device cuda] [--workers 8]
"""
import argparse
import json
import os
import resource
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402
from bench_crf import natural_image  # noqa: E402

from mars_plugin.formats.files import write_image, write_label  # noqa: E402
from mars_plugin.commands.train import train  # noqa: E402


def make_tree(root: str, n: int, H: int = 375, W: int = 500, classes: int = 20) -> None:
    """Images, pseudo labels (ellipses of 1-3 classes) and debiased labels (a quarter of each
    object's pixels 254) under root/{images,pseudo,debiased}."""
    for i in range(n):
        r = np.random.default_rng(i)
        img = natural_image(H, W, i)
        lab = np.zeros((H, W), np.int64)
        yy, xx = np.mgrid[0:H, 0:W]
        for c in r.choice(np.arange(1, classes + 1), size=r.integers(1, 4), replace=False):
            cy, cx, ry, rx = r.uniform(0, H), r.uniform(0, W), r.uniform(H / 8, H / 3), r.uniform(W / 8, W / 3)
            lab[((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1] = c
        deb = lab.copy()
        deb[(lab > 0) & (xx % 4 == 0)] = 254
        write_image(os.path.join(root, "images", f"im{i:04d}.jpg"), img)
        write_label(os.path.join(root, "pseudo", f"im{i:04d}.png"), torch.from_numpy(lab))
        write_label(os.path.join(root, "debiased", f"im{i:04d}.png"), torch.from_numpy(deb))


def run(root: str, kind: str, args) -> dict:
    loss, refine = {"ce": ("ce", None), "mars+crf": ("mars", "crf"), "mars": ("mars", None)}[kind]
    out = os.path.join(root, f"run_{kind}")
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    train(os.path.join(root, "images"), os.path.join(root, "pseudo" if loss == "ce" else "debiased"), out, 20,
          arch=args.arch, output_stride=args.output_stride, backbone=args.backbone, loss=loss, refine=refine, iterations=args.steps,
          batch_size=args.batch, crop=args.crop, device=args.device, workers=args.workers,
          save_every=10 ** 6, log_every=1, progress=False, amp=not args.no_amp)
    wall = time.perf_counter() - t0
    el = [json.loads(line)["elapsed_s"] for line in open(os.path.join(out, "log.jsonl"))]
    per = np.diff(el)[args.warmup - 1:] if len(el) > args.warmup else np.diff([0.0] + el)
    res = {"s_step": float(np.median(per)), "min": float(np.min(per)), "max": float(np.max(per)), "wall": wall}
    if args.device.startswith("cuda"):
        res["peak_gb"] = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        res["peak_gb"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 2 ** 20  # KB -> GB growth
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="deeplabv3+")
    # 16: the stride of the measured rows in docs/benchmarks.md (mars train's dhr recipe trains at 8)
    ap.add_argument("--output-stride", type=int, default=16)
    ap.add_argument("--backbone", default="resnet101")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--crop", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--kinds", default="ce,mars+crf,mars")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-amp", action="store_true")
    args = ap.parse_args()
    print(machine_line("cuda" if args.device.startswith("cuda") else "cpu"))
    print(f"mars train: {args.arch} {args.backbone}, batch {args.batch} x {args.crop}x{args.crop}, "
          f"{'AMP' if args.device.startswith('cuda') and not args.no_amp else 'fp32'}, {args.workers} loader workers; "
          f"s/step = median of steps {args.warmup + 1}..{args.steps} (min-max); peak = "
          f"{'torch.cuda.max_memory_allocated' if args.device.startswith('cuda') else 'growth of peak RSS'}")
    print("| loss | s/step | min-max | ratio to CE | peak GB | VOC 30k steps |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as root:
        make_tree(root, args.images)
        base = None
        for kind in args.kinds.split(","):
            r = run(root, kind, args)
            base = r["s_step"] if kind == "ce" else base
            ratio = f"{r['s_step'] / base:.2f}" if base else "-"
            print(f"| {kind} | {r['s_step']:.3f} | {r['min']:.3f}-{r['max']:.3f} | {ratio} | {r['peak_gb']:.2f} | "
                  f"{30000 * r['s_step'] / 3600:.1f} h |", flush=True)


if __name__ == "__main__":
    main()
