"""Batched torch K-means vs one scikit-learn KMeans per (image, class) problem.

Prints wall time per problem set and the inertia ratio (ours / scikit-learn). Not a test.
Usage: python benchmarks/bench_kmeans.py [--problems 300] [--points 400] [--dim 70]
"""
import argparse
import os
import platform
import time

import numpy as np
import torch
from sklearn.cluster import KMeans

from mars_plugin.kmeans import batched_kmeans


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--problems", type=int, default=300, help="number of (image, class) problems")
    ap.add_argument("--points", type=int, default=400, help="max pixels per problem")
    ap.add_argument("--dim", type=int, default=70, help="embedding size D")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    sizes = rng.integers(args.k, args.points + 1, size=args.problems)
    problems = []
    for n in sizes:
        centers = rng.normal(size=(args.k, args.dim))
        x = centers[rng.integers(0, args.k, n)] + 0.3 * rng.normal(size=(n, args.dim))
        problems.append((x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32))

    pts = torch.zeros(args.problems, int(sizes.max()), args.dim)
    mask = torch.zeros(args.problems, int(sizes.max()), dtype=torch.bool)
    for i, x in enumerate(problems):
        pts[i, : len(x)] = torch.from_numpy(x)
        mask[i, : len(x)] = True

    t0 = time.perf_counter()
    res = batched_kmeans(pts, mask, args.k, seeds=list(range(args.problems)))
    t_ours = time.perf_counter() - t0

    t0 = time.perf_counter()
    sk_inertia = [KMeans(args.k, n_init=10, random_state=0).fit(x).inertia_ for x in problems]
    t_sk = time.perf_counter() - t0

    sk = np.array(sk_inertia)
    ours = res.inertia.numpy()
    # Ratios only where scikit-learn's inertia is not ~0 (a 2-point problem with K=2 has 0).
    big = sk > 1e-6
    ratio = ours[big] / sk[big]
    tiny_diff = float(np.abs(ours[~big] - sk[~big]).max()) if (~big).any() else 0.0
    print(f"machine: {platform.processor() or platform.machine()}, cpus={os.cpu_count()}, "
          f"torch threads={torch.get_num_threads()}, device=cpu, torch {torch.__version__}")
    print(f"{args.problems} problems, <= {args.points} points, D={args.dim}, K={args.k}")
    print("| method | wall s | problems/s |")
    print("| --- | --- | --- |")
    print(f"| mars_plugin batched_kmeans (n_init=1) | {t_ours:.3f} | {args.problems / t_ours:.0f} |")
    print(f"| scikit-learn KMeans(n_init=10) per problem | {t_sk:.3f} | {args.problems / t_sk:.0f} |")
    print(f"speed-up: {t_sk / t_ours:.1f}x; inertia ratio ours/sklearn: median {np.median(ratio):.5f}, "
          f"max {ratio.max():.5f}; |difference| where sklearn ~0: {tiny_diff:.2e}")


if __name__ == "__main__":
    main()
