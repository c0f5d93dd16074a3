"""Read throughput of each WSSS adapter and `mars features` throughput (random-weight ViT-S/8).

Writes --images fixtures per repository format in a temp dir (label PNGs in the repository's
mode, CAM files in its pickled layout), then times `load_pseudo_labels` and `load_cams` over
them; then times STEGO feature extraction with a random ViT-S/8 (depth 12, D=70) at 320 px on
CPU, and on CUDA when present. Prints tables; never a test.

    python benchmarks/bench_adapters.py [--images 100] [--feature-images 4]
"""
import argparse
import os
import pickle
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.adapters.wsss import advcam, irnet, rsepm, seam  # noqa: E402
from mars_plugin.adapters.uss.stego import STEGOExtractor  # noqa: E402
from mars_plugin.adapters.uss.vit import DinoViT  # noqa: E402
from mars_plugin.formats.files import write_label  # noqa: E402

H, W = 320, 480


def write_fixtures(root, n, rng):
    for name, mode in (("irnet", "L"), ("advcam", "L"), ("seam", "L"), ("rsepm", "P")):
        os.makedirs(os.path.join(root, name, "labels"), exist_ok=True)
        os.makedirs(os.path.join(root, name, "cams"), exist_ok=True)
    for i in range(n):
        stem = f"2007_{i:06d}"
        lab = torch.from_numpy(rng.integers(0, 21, size=(H, W)))
        keys = np.array([3, 11])
        for name, mode in (("irnet", "L"), ("advcam", "L"), ("seam", "L"), ("rsepm", "P")):
            write_label(os.path.join(root, name, "labels", stem + ".png"), lab, mode=mode)
        cam = rng.random((2, H, W)).astype(np.float32)
        for name in ("irnet", "advcam"):  # make_cam.py layout
            np.save(os.path.join(root, name, "cams", stem + ".npy"), {
                "keys": torch.from_numpy(keys), "cam": torch.from_numpy(cam[:, ::4, ::4].copy()), "high_res": cam})
        np.save(os.path.join(root, "seam", "cams", stem + ".npy"), {int(k): cam[j] for j, k in enumerate(keys)})
        with open(os.path.join(root, "rsepm", "cams", stem + ".pkl"), "wb") as fh:
            pickle.dump({"keys": np.concatenate([[0], keys + 1]), "seed": cam}, fh)


def time_adapters(root, n):
    rows = []
    for mod in (irnet, advcam, seam, rsepm):
        name = mod.NAME
        t0 = time.perf_counter()
        count = sum(1 for _ in mod.load_pseudo_labels(os.path.join(root, name, "labels")))
        t_lab = time.perf_counter() - t0
        ext = ".pkl" if name == "rsepm" else ".npy"
        cam_dir = os.path.join(root, name, "cams")
        t0 = time.perf_counter()
        for f in sorted(os.listdir(cam_dir)):
            if f.endswith(ext):
                mod.load_cams(os.path.join(cam_dir, f), trust_pickle=True)
        t_cam = time.perf_counter() - t0
        rows.append((name, count / t_lab, n / t_cam))
    return rows


def stego_random(device):
    torch.manual_seed(0)
    vit = DinoViT(patch_size=8, embed_dim=384, depth=12, num_patches=(224 // 8) ** 2)
    c1 = nn.Sequential(nn.Conv2d(384, 70, 1))
    c2 = nn.Sequential(nn.Conv2d(384, 384, 1), nn.ReLU(), nn.Conv2d(384, 70, 1))
    return STEGOExtractor(vit, c1, c2, res=320).to(device).eval()


def time_features(device, n, fp16):
    ex = stego_random(device)
    imgs = torch.randint(0, 256, (n, 3, 375, 500), dtype=torch.uint8).to(device)
    with torch.no_grad(), torch.autocast(device_type=device, dtype=torch.float16, enabled=fp16):
        ex(imgs[:1])  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(n):
            ex(imgs[i : i + 1])
        if device == "cuda":
            torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=100)
    ap.add_argument("--feature-images", type=int, default=4)
    args = ap.parse_args()
    print(machine_line("cpu"))
    with tempfile.TemporaryDirectory() as root:
        write_fixtures(root, args.images, np.random.default_rng(0))
        print(f"WSSS adapters, {args.images} images of {H}x{W}")
        print("| adapter | pseudo labels/s | CAM files/s |")
        print("| --- | --- | --- |")
        for name, lab, cam in time_adapters(root, args.images):
            print(f"| {name} | {lab:.0f} | {cam:.0f} |")
    print("\nmars features: STEGO, random ViT-S/8 (depth 12, D=70), 375x500 input at res 320, flip averaged")
    print("| device | precision | images/s |")
    print("| --- | --- | --- |")
    print(f"| cpu | fp32 | {time_features('cpu', args.feature_images, False):.2f} |", flush=True)
    if torch.cuda.is_available():
        print(machine_line("cuda"))
        print(f"| cuda | fp32 | {time_features('cuda', 32, False):.1f} |")
        print(f"| cuda | fp16 | {time_features('cuda', 32, True):.1f} |")


if __name__ == "__main__":
    main()
