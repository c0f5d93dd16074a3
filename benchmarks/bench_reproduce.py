"""Seconds per image of each `mars reproduce` stage on a generated DHR-layout tree of VOC-sized
(500x375) images, with a random-weight STEGO of the real size (DINO ViT-B/8 + 70-d heads, DHR's
two files) and DHR's multi-scale inference (scales 2, 1, 1.5, 0.5, flip), extrapolated to VOC
train_aug (10,582 images), or with ``--data COCO2014`` to COCO's 81 classes (2-4 objects an image,
extrapolated to COCO 2014 train, 82,783 images). Peak memory: the process's maximum RSS and,
on a GPU, ``torch.cuda.max_memory_allocated``.

``--given-features D`` skips the network: random (D, H/8, W/8) features are written first and
given with ``--features``, which times the stages that depend on the class count (centroids,
debias, evaluate) on a CPU in minutes.

The weights are random, so the scores mean nothing here; the work per image is the real one.

    python benchmarks/bench_reproduce.py [--images 16] [--device cuda] [--fp16 | --compare-fp16] [--arch b8|s8|t8]
                                         [--data VOC2012|COCO2014] [--given-features 70]
"""
import argparse
import json
import os
import resource
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.adapters.wsss._common import VOC_CLASSES  # noqa: E402
from mars_plugin.adapters.uss.vit import DinoViT  # noqa: E402
from mars_plugin.formats.files import write_image, write_label  # noqa: E402
from mars_plugin.commands.reproduce import reproduce  # noqa: E402
from mars_plugin.commands.reproduce_report import PAPER_COCO_CLASSES  # noqa: E402

VOC_TRAIN_AUG = 10582
COCO_TRAIN = 82783
#: (width, depth, patch). b8 is DHR's STEGO; t8 (2 blocks) is only a quick check that the script runs.
ARCHS = {"b8": (768, 12, 8), "s8": (384, 12, 8), "t8": (192, 2, 8)}


def make_tree(root: str, n: int, H: int = 375, W: int = 500, seed: int = 0, data: str = "VOC2012"):
    """<root>/<data>/<domain>/{image,mask,xml} and <root>/pseudo: rectangle objects (one for VOC,
    2-4 of the 80 classes for COCO2014) on a two-part background, each pseudo label spilling into
    the ground below its object. COCO2014 also gets its json (81 names)."""
    rng = np.random.default_rng(seed)
    coco = data == "COCO2014"
    names = PAPER_COCO_CLASSES if coco else VOC_CLASSES
    C = len(names) - 1
    dom = os.path.join(root, data, "train" if coco else "train_aug")
    for sub in ("image", "mask", "xml"):
        os.makedirs(os.path.join(dom, sub), exist_ok=True)
    if coco:
        with open(os.path.join(root, data, f"{data}.json"), "w") as fh:
            json.dump({"names": list(names), "ignore": 255}, fh)
    colours = rng.integers(0, 256, size=(C + 4, 3))
    for i in range(n):
        classes = rng.choice(np.arange(1, C + 1), int(rng.integers(2, 5)), replace=False) if coco else [1 + i % 20]
        gt = np.zeros((H, W), np.int64)
        pseudo = gt.copy()
        for c in classes:
            h, w = (H // 3, W // 3) if not coco else (H // 5, W // 5)
            y0, x0 = rng.integers(20, H // 2), rng.integers(20, W - w - 1)
            gt[y0:y0 + h, x0:x0 + w] = c
            pseudo[y0:y0 + h + 30, x0:x0 + w] = c  # the biased band below the object
        kinds = gt.copy()
        kinds[H // 2:][kinds[H // 2:] == 0] = C + 1 + i % 3
        img = np.clip(colours[kinds] + rng.normal(0, 12, size=(H, W, 3)), 0, 255).astype(np.uint8)
        stem = f"COCO_train2014_{i:012d}" if coco else f"2007_{i:06d}"
        write_image(os.path.join(dom, "image", stem + ".jpg"), img)
        write_label(os.path.join(dom, "mask", stem + ".png"), torch.from_numpy(gt))
        write_label(os.path.join(root, "pseudo", stem + ".png"), torch.from_numpy(pseudo))
        ann = ET.Element("annotation")
        for c in sorted(set(int(x) for x in np.unique(gt)) - {0}):
            ET.SubElement(ET.SubElement(ann, "object"), "name").text = names[c]
        ET.ElementTree(ann).write(os.path.join(dom, "xml", stem + ".xml"))


def write_given_features(root: str, dim: int, seed: int = 0) -> str:
    """Random (dim, ceil(H/8), ceil(W/8)) fp16 features for every pseudo label, as DHR's .pt files."""
    from mars_plugin.formats.files import read_label

    g = torch.Generator().manual_seed(seed)
    out = os.path.join(root, "given_features")
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(os.path.join(root, "pseudo"))):
        H, W = read_label(os.path.join(root, "pseudo", name)).shape
        f = torch.randn(dim, -(-H // 8), -(-W // 8), generator=g).half()
        torch.save(f, os.path.join(out, name[:-4] + ".pt"))
    return out


def make_weights(root: str, arch: str, dim: int = 70):
    width, depth, patch = ARCHS[arch]
    torch.manual_seed(0)
    vit = DinoViT(patch_size=patch, embed_dim=width, depth=depth, num_patches=784)
    for p in vit.parameters():
        torch.nn.init.normal_(p, std=0.02)
    conv = torch.nn.Conv2d
    heads = {"cluster1": torch.nn.Sequential(conv(width, dim, 1)).state_dict(),
             "cluster2": torch.nn.Sequential(conv(width, width, 1), torch.nn.ReLU(), conv(width, dim, 1)).state_dict()}
    b, h = os.path.join(root, f"dino_vit{arch}.pth"), os.path.join(root, "STEGO_VOC2012.pt")
    torch.save(vit.state_dict(), b)
    torch.save(heads, h)
    return b, h


def _table(stages, n, total, data="VOC2012"):
    full, label = (COCO_TRAIN, "COCO 2014 train (82,783 images)") if data == "COCO2014" else (
        VOC_TRAIN_AUG, "VOC train_aug (10,582 images)")
    print(f"| stage | s total | s per image | {label} |")
    print("| --- | --- | --- | --- |")
    for name, info in stages.items():
        sec = info["seconds"]
        print(f"| {name} | {sec:.2f} | {sec / n:.3f} | {sec / n * full / 60:.0f} min |")
    print(f"| all (incl. set-up) | {total:.2f} | {total / n:.3f} | {total / n * full / 60:.0f} min |")


def _agreement(out_a: str, out_b: str):
    """Mean and min per-pixel cosine of the two runs' features, and the share of debiased-label
    pixels that are equal."""
    from mars_plugin.formats.files import read_features, read_label

    cos, equal, total = [], 0, 0
    for name in sorted(os.listdir(os.path.join(out_a, "features"))):
        fa = read_features(os.path.join(out_a, "features", name))
        fb = read_features(os.path.join(out_b, "features", name))
        cos.append(torch.nn.functional.cosine_similarity(fa, fb, dim=0).flatten())
        stem = name[:-3]
        la = read_label(os.path.join(out_a, "debiased", stem + ".png"))
        lb = read_label(os.path.join(out_b, "debiased", stem + ".png"))
        equal += int((la == lb).sum())
        total += la.numel()
    cos = torch.cat(cos)
    return float(cos.mean()), float(cos.min()), equal / total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fp16", action="store_true", help="features under float16 autocast")
    ap.add_argument("--compare-fp16", action="store_true",
                    help="run float32 and float16 autocast on the same tree and compare features and labels")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="b8")
    ap.add_argument("--batch-size", type=int, default=16, help="images per CRF call")
    ap.add_argument("--data", choices=("VOC2012", "COCO2014"), default="VOC2012",
                    help="VOC's 21 classes, or COCO 2014's 81 (2-4 objects an image)")
    ap.add_argument("--given-features", type=int, default=None, metavar="D",
                    help="skip the network: write random D-channel features and give them with --features")
    args = ap.parse_args()
    print(machine_line(args.device))
    print(f"load average: {os.getloadavg()}")
    runs = [False, True] if args.compare_fp16 else [args.fp16]
    n = args.images
    with tempfile.TemporaryDirectory() as tmp:
        make_tree(tmp, n, data=args.data)
        if args.given_features:
            model = {"features_dir": write_given_features(tmp, args.given_features)}
            what = f"random given features (D={args.given_features}, 1/8 of the image)"
        else:
            b, h = make_weights(tmp, args.arch)
            model = {"backbone": b, "heads": h}
            what = f"STEGO ViT-{args.arch.upper()} random weights, DHR scales 2,1,1.5,0.5 + flip"
        for fp16 in runs:
            out = os.path.join(tmp, "out16" if fp16 else "out32")
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            if args.device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            t = time.perf_counter()
            reproduce(tmp, os.path.join(tmp, "pseudo"), out, data=args.data, device=args.device, fp16=fp16,
                      batch_size=args.batch_size, progress=False, log=lambda s: None, **model)
            total = time.perf_counter() - t
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            with open(os.path.join(out, "reproduce.json")) as fh:
                stages = json.load(fh)["stages"]
            C1 = 81 if args.data == "COCO2014" else 21
            print(f"\n{n} images of 500x375, {args.data} ({C1} classes), {what}, device {args.device}"
                  f"{', fp16 autocast' if fp16 else ', float32'}\n")
            _table(stages, n, total, args.data)
            mem = f"peak RSS {rss / 1024:.0f} MB (grew {(rss - rss0) / 1024:.0f} MB in this run)"
            if args.device.startswith("cuda"):
                mem += f", peak GPU memory allocated {torch.cuda.max_memory_allocated() / 2**20:.0f} MB"
            print(f"\nmemory: {mem}")
        if args.compare_fp16:
            mean, low, same = _agreement(os.path.join(tmp, "out32"), os.path.join(tmp, "out16"))
            print(f"\nfloat16 autocast against float32: per-pixel feature cosine mean {mean:.6f}, min {low:.6f}; "
                  f"debiased labels equal on {100 * same:.4f}% of the pixels")


if __name__ == "__main__":
    main()
