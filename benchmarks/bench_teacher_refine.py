"""The teacher refinement R of Eq. 6: argmax vs the per-image dense CRF vs the batched local CRF.

Time: one batch of B teacher outputs (C+1 = 21 channels, each image allowed background + 2
classes) at S x S, refined by each method (mean of --repeats after one warm-up). Quality: on the
built-in synthetic world (its RGB images and ground truth), teacher probabilities made from the
ground truth with smooth noise (a teacher that is right on average but blotchy), refined by each
method: pixel accuracy against the ground truth, and how often the local CRF's label agrees with
the dense CRF's. Prints tables; never a test.

    python benchmarks/bench_teacher_refine.py [--batch 8] [--size 320] [--device cuda]
"""
import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.complement import teacher_labels  # noqa: E402
from mars_plugin.synthetic import make_world  # noqa: E402

METHODS = (None, "crf", "local_crf")


def _allowed(B, C, g):
    allowed = torch.zeros(B, C + 1, dtype=torch.bool)
    allowed[:, 0] = True
    for b in range(B):
        allowed[b, 1 + torch.randperm(C, generator=g)[:2]] = True
    return allowed


def timing(args, dev):
    g = torch.Generator().manual_seed(0)
    C = 20
    logits = F.interpolate(torch.randn(args.batch, C + 1, args.size // 8, args.size // 8, generator=g) * 3,
                           size=(args.size, args.size), mode="bilinear", align_corners=False)
    probs = logits.softmax(1).to(dev)
    rgb = (torch.rand(args.batch, args.size, args.size, 3, generator=g) * 255).to(torch.uint8)
    allowed = _allowed(args.batch, C, g).to(dev)
    print(f"\nTime per batch of {args.batch} x {C + 1} x {args.size} x {args.size} (2 classes per image allowed):")
    print("| refine | s/batch | images/s |")
    print("| --- | --- | --- |")
    for m in METHODS:
        if m == "crf" and not args.crf:
            continue
        img = rgb.to(dev) if m == "local_crf" else rgb
        teacher_labels(probs, allowed, refine=m, image=img)
        times = []
        for _ in range(args.repeats):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            teacher_labels(probs, allowed, refine=m, image=img)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = sum(times) / len(times)
        print(f"| {m or 'argmax'} | {t:.4f} | {args.batch / t:.1f} |", flush=True)


def quality(args):
    w = make_world(args.quality_images, size=args.quality_size, seed=1)
    g = torch.Generator().manual_seed(1)
    C = w.num_classes
    onehot = F.one_hot(w.gt, C + 1).permute(0, 3, 1, 2).float()
    noise = F.interpolate(torch.randn(len(w), C + 1, args.quality_size // 8, args.quality_size // 8, generator=g),
                          size=w.gt.shape[-2:], mode="bilinear", align_corners=False)
    probs = (1.2 * onehot + 1.0 * noise).softmax(1)
    allowed = torch.cat([torch.ones(len(w), 1, dtype=torch.bool), w.image_classes], 1)
    labels = {m: teacher_labels(probs, allowed, refine=m, image=w.images) for m in METHODS}
    print(f"\nQuality on {len(w)} synthetic {args.quality_size}x{args.quality_size} images "
          "(teacher = ground truth + smooth noise):")
    print("| refine | pixel accuracy | agreement with the dense CRF |")
    print("| --- | --- | --- |")
    for m in METHODS:
        acc = (labels[m] == w.gt).float().mean().item()
        agree = (labels[m] == labels["crf"]).float().mean().item()
        print(f"| {m or 'argmax'} | {100 * acc:.1f}% | {100 * agree:.1f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-crf", dest="crf", action="store_false", help="skip the (slow) per-image dense CRF timing")
    ap.add_argument("--quality-images", type=int, default=32)
    ap.add_argument("--quality-size", type=int, default=128)
    args = ap.parse_args()
    print(machine_line(args.device))
    timing(args, args.device)
    quality(args)


if __name__ == "__main__":
    main()
