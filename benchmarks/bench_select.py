"""select_centroids vs the paper-literal baseline (benchmarks/paper_literal.py).

Same generated features for both (N images, D, 40x40 grid, VOC-like 20 classes, streamed so that
no method ever holds the dataset): wall time, peak RSS (each method in its own process), and the
cosine between the two selected centroids of every class. Prints a table; never a test.

    python benchmarks/bench_select.py                      # N = 500, 2000, 10000; D = 70, 384
    python benchmarks/bench_select.py --sizes 500 --dims 70 --baseline-max 500
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def feature_stream(n: int, dim: int, grid: int = 40, num_classes: int = 20, seed: int = 0):
    """(features (D, grid, grid) float32, label (grid, grid) int64) per image, made on the fly.

    Each image: a background of 1-2 context kinds, 1-2 objects; some classes carry a biased
    context (a band of the context labelled with the class), as in the paper's failure.
    """
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(num_classes + 1 + 8, dim)).astype(np.float32)
    protos /= np.linalg.norm(protos, axis=1, keepdims=True)
    for i in range(n):
        r = np.random.default_rng([seed, i])
        kinds = np.full((grid, grid), num_classes + 1 + r.integers(0, 8), dtype=np.int64)
        kinds[grid // 2 :] = num_classes + 1 + r.integers(0, 8)
        label = np.zeros((grid, grid), dtype=np.int64)
        for _ in range(r.integers(1, 3)):
            c = int(r.integers(1, num_classes + 1))
            h, w = r.integers(6, grid // 2, size=2)
            y0, x0 = r.integers(0, grid - h), r.integers(0, grid - w)
            kinds[y0 : y0 + h, x0 : x0 + w] = c
            label[y0 : y0 + h, x0 : x0 + w] = c
            if c % 3 == 0:  # a biased class: its context band is labelled too
                label[min(grid - 1, y0 + h) : min(grid, y0 + h + 4), x0 : x0 + w] = c
        # Noise of norm ~0.5 around unit prototypes: structured like USS embeddings, not pure noise.
        noise = (0.5 / np.sqrt(dim)) * r.normal(size=(dim, grid, grid)).astype(np.float32)
        feats = protos[kinds].transpose(2, 0, 1) + noise
        yield feats.astype(np.float32), label


def run_one(method: str, n: int, dim: int, out: str, batch_size: int, device: str) -> None:
    """Run one method in this process and write its timing, RSS and centroids to ``out``."""
    t0 = time.perf_counter()
    if method == "ours":
        from mars_plugin import select_centroids

        V = select_centroids(
            ((torch.from_numpy(f).to(device), torch.from_numpy(y).to(device)) for f, y in feature_stream(n, dim)),
            20, batch_size=batch_size,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        cents = {int(c): V.centroids[c].cpu().numpy().tolist() for c in range(1, 21) if bool(V.valid[c])}
    else:
        sys.path.insert(0, HERE)
        from paper_literal import paper_literal_select

        cents = {c: v.tolist() for c, v in paper_literal_select(feature_stream(n, dim), 20).items()}
    wall = time.perf_counter() - t0
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(out, "w") as fh:
        json.dump({"wall": wall, "rss_mb": rss_mb, "centroids": cents}, fh)


def _sub(method, n, dim, batch_size, device):
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
        path = tmp.name
    cmd = [sys.executable, os.path.abspath(__file__), "--_run", method, "--sizes", str(n), "--dims", str(dim),
           "--batch-size", str(batch_size), "--device", device, "--_out", path]
    subprocess.run(cmd, check=True)
    with open(path) as fh:
        res = json.load(fh)
    os.unlink(path)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="500,2000,10000", help="numbers of images N")
    ap.add_argument("--dims", default="70,384", help="embedding sizes D")
    ap.add_argument("--baseline-max", type=int, default=2000, help="largest N the baseline is run at")
    ap.add_argument("--batch-size", type=int, default=32, help="images per batched K-means call (ours)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--_run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    if args._run:
        run_one(args._run, sizes[0], dims[0], args._out, args.batch_size, args.device)
        return

    dev_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"machine: cpus={os.cpu_count()}, torch threads={torch.get_num_threads()}, device={args.device} "
          f"({dev_name}), torch {torch.__version__}; grid 40x40, 20 classes, K_fg=K_bg=2, alpha=0.4")
    print("| N | D | ours s | ours peak RSS MB | baseline s | baseline peak RSS MB | speed-up | min cos per class |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    per_image = {}
    for dim in dims:
        for n in sizes:
            ours = _sub("ours", n, dim, args.batch_size, args.device)
            per_image[("ours", dim)] = ours["wall"] / n
            if n <= args.baseline_max:
                base = _sub("baseline", n, dim, args.batch_size, "cpu")
                per_image[("baseline", dim)] = base["wall"] / n
                common = sorted(set(ours["centroids"]) & set(base["centroids"]), key=int)
                cos = [float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))
                       for a, b in ((np.array(ours["centroids"][c]), np.array(base["centroids"][c])) for c in common)]
                print(f"| {n} | {dim} | {ours['wall']:.2f} | {ours['rss_mb']:.0f} | {base['wall']:.1f} | "
                      f"{base['rss_mb']:.0f} | {base['wall'] / ours['wall']:.0f}x | {min(cos):.5f} |", flush=True)
            else:
                est = per_image.get(("baseline", dim), float("nan")) * n
                print(f"| {n} | {dim} | {ours['wall']:.2f} | {ours['rss_mb']:.0f} | ~{est:.0f} (extrapolated) | - | "
                      f"~{est / ours['wall']:.0f}x | - |", flush=True)
    print("\nExtrapolation from the per-image time at the largest N measured (one process):")
    print("| D | method | COCO 80k images | Open Images 9M images |")
    print("| --- | --- | --- | --- |")
    for dim in dims:
        for method in ("ours", "baseline"):
            t = per_image.get((method, dim))
            if t is not None:
                print(f"| {dim} | {method} | {t * 80_000 / 3600:.2f} h | {t * 9_000_000 / 3600:.1f} h |")


if __name__ == "__main__":
    main()
