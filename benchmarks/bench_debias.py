"""Images per second of `mars debias` (the folder job) for refine=threshold and refine=crf,
with 1 and 2 worker processes, on generated 320x480 images with D=70 features at stride 8.

    python benchmarks/bench_debias.py [--images 64] [--workers 1,2]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin import select_centroids  # noqa: E402
from mars_plugin.files import write_features, write_image, write_label  # noqa: E402
from mars_plugin.jobs import debias_job  # noqa: E402


def make_folder(root: str, n: int, H: int = 320, W: int = 480, D: int = 70, stride: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(8, D)).astype(np.float32)
    colours = rng.integers(0, 256, size=(8, 3))
    for i in range(n):
        kinds = np.zeros((H, W), np.int64)
        kinds[H // 2 :] = 1 + i % 3
        y0, x0 = rng.integers(0, H // 2), rng.integers(0, W // 2)
        kinds[y0 : y0 + H // 3, x0 : x0 + W // 3] = 4 + i % 4
        label = np.where(kinds >= 4, kinds - 3, 0)
        label[y0 + H // 3 : y0 + H // 3 + 20, x0 : x0 + W // 3] = label[y0, x0]  # a biased band
        small = kinds[stride // 2 :: stride, stride // 2 :: stride]
        feats = protos[small].transpose(2, 0, 1) + 0.05 * rng.normal(size=(D,) + small.shape).astype(np.float32)
        img = np.clip(colours[kinds] + rng.normal(0, 10, size=(H, W, 3)), 0, 255).astype(np.uint8)
        stem = f"img{i:05d}"
        write_features(os.path.join(root, "features", stem + ".npy"), feats)
        write_label(os.path.join(root, "labels", stem + ".png"), torch.from_numpy(label))
        write_image(os.path.join(root, "images", stem + ".png"), img)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--workers", default="1,2")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        make_folder(root, args.images)
        from mars_plugin.files import read_features, read_label

        stems = sorted(f[:-4] for f in os.listdir(os.path.join(root, "features")))
        V = select_centroids(((read_features(os.path.join(root, "features", s + ".npy")),
                               read_label(os.path.join(root, "labels", s + ".png"))) for s in stems), 4)
        V.save(os.path.join(root, "V.pt"))
        print(machine_line())
        print(f"{args.images} images 320x480, features D=70 at stride 8")
        print("| refine | workers | s | images/s |")
        print("| --- | --- | --- | --- |")
        for refine in ("threshold", "crf"):
            for w in (int(x) for x in args.workers.split(",")):
                out = os.path.join(root, f"out_{refine}_{w}")
                t0 = time.perf_counter()
                s = debias_job(os.path.join(root, "features"), os.path.join(root, "labels"), os.path.join(root, "V.pt"),
                               out, images_dir=os.path.join(root, "images"), refine=refine, workers=w, progress=False)
                dt = time.perf_counter() - t0
                assert s.done == args.images
                print(f"| {refine} | {w} | {dt:.2f} | {args.images / dt:.1f} |", flush=True)


if __name__ == "__main__":
    main()
