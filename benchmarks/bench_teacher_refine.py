"""The teacher refinement R of Eq. 6: argmax vs the dense CRF (ours, batched; pydensecrf, one
image at a time) vs the windowed local CRF, all with the default ("mars") parameters.

Time: one batch of B teacher outputs (C+1 = 21 channels, each image allowed background + 2
classes) at S x S over generated natural-looking images (bench_crf.natural_image), refined by
each method (median of --repeats after one warm-up). Quality: on the built-in synthetic world
(its RGB images and ground truth), teacher probabilities made from the ground truth with smooth
noise (a teacher that is right on average but blotchy), refined by each method: pixel accuracy
against the ground truth, and how often each label agrees with pydensecrf's. Prints tables;
never a test.

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
from bench_crf import natural_image  # noqa: E402

from mars_plugin.method.complement import teacher_labels  # noqa: E402
from mars_plugin.worlds.synthetic_scenes import make_world  # noqa: E402

# (name, refine, crf_backend)
METHODS = (("argmax", None, "torch"), ("dense CRF, ours", "crf", "torch"),
           ("dense CRF, pydensecrf", "crf", "pydensecrf"), ("local_crf", "local_crf", "torch"))


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
    rgb = torch.stack([torch.from_numpy(natural_image(args.size, args.size, b)) for b in range(args.batch)]).to(dev)
    allowed = _allowed(args.batch, C, g).to(dev)
    print(f"\nTime per batch of {args.batch} x {C + 1} x {args.size} x {args.size} (2 classes per image allowed):")
    print("| refine | s/batch | images/s |")
    print("| --- | --- | --- |")
    for name, refine, backend in METHODS:
        if backend == "pydensecrf" and not args.reference:
            continue
        teacher_labels(probs, allowed, refine=refine, image=rgb, crf_backend=backend)
        times = []
        for _ in range(args.repeats):
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            teacher_labels(probs, allowed, refine=refine, image=rgb, crf_backend=backend)
            if dev == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = sorted(times)[len(times) // 2]
        print(f"| {name} | {t:.4f} | {args.batch / t:.1f} |", flush=True)


def quality(args):
    w = make_world(args.quality_images, size=args.quality_size, seed=1)
    g = torch.Generator().manual_seed(1)
    C = w.num_classes
    onehot = F.one_hot(w.gt, C + 1).permute(0, 3, 1, 2).float()
    noise = F.interpolate(torch.randn(len(w), C + 1, args.quality_size // 8, args.quality_size // 8, generator=g),
                          size=w.gt.shape[-2:], mode="bilinear", align_corners=False)
    probs = (1.2 * onehot + 1.0 * noise).softmax(1)
    allowed = torch.cat([torch.ones(len(w), 1, dtype=torch.bool), w.image_classes], 1)
    methods = [m for m in METHODS if args.reference or m[2] != "pydensecrf"]
    labels = {name: teacher_labels(probs, allowed, refine=refine, image=w.images, crf_backend=backend)
              for name, refine, backend in methods}
    ref = "dense CRF, pydensecrf" if args.reference else "dense CRF, ours"
    print(f"\nQuality on {len(w)} synthetic {args.quality_size}x{args.quality_size} images "
          "(teacher = ground truth + smooth noise):")
    print(f"| refine | pixel accuracy | agreement with {ref} |")
    print("| --- | --- | --- |")
    for name, _, _ in methods:
        acc = (labels[name] == w.gt).float().mean().item()
        agree = (labels[name] == labels[ref]).float().mean().item()
        print(f"| {name} | {100 * acc:.2f}% | {100 * agree:.3f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--size", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-reference", dest="reference", action="store_false",
                    help="skip pydensecrf (also skipped when it is not installed)")
    ap.add_argument("--quality-images", type=int, default=32)
    ap.add_argument("--quality-size", type=int, default=128)
    args = ap.parse_args()
    try:
        import pydensecrf  # noqa: F401
    except ImportError:
        args.reference = False
    print(machine_line(args.device))
    timing(args, args.device)
    quality(args)


if __name__ == "__main__":
    main()
