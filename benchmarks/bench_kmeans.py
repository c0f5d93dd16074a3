"""Our two K-means backends vs one scikit-learn KMeans per (image, class) problem.

Batched torch K-means and, when numba is installed, the compiled kernel (its load happens before
the clock). Prints wall time per problem set and the inertia ratio (ours / scikit-learn). Not a
test.
Usage: python benchmarks/bench_kmeans.py [--problems 300] [--points 400] [--dim 70]
"""
import argparse
import os
import platform
import time

import numpy as np
import torch
from sklearn.cluster import KMeans

from mars_plugin.engines import kmeans_compiled
from mars_plugin.engines.kmeans import _uniforms, batched_kmeans, seeding_trials


def compiled_inertia(problems, k, max_iter=100, tol=1e-4):
    """(wall s, inertia per problem) of the compiled kernel on the same problems and seeds."""
    cols = np.ascontiguousarray(np.concatenate(problems).T)  # (D, total points)
    sizes = np.array([len(x) for x in problems], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    ks = np.full(len(problems), k, dtype=np.int64)
    trials = np.full(len(problems), seeding_trials(k), dtype=np.int64)
    u = _uniforms(list(range(len(problems))), ks.tolist(), trials.tolist(), torch.device("cpu")).numpy()
    args = (cols, np.arange(cols.shape[1]), starts, sizes, ks, u, trials)
    kmeans_compiled.kmeans_groups(*args, normalize=False, max_iter=max_iter, tol=tol)  # load / compile
    t0 = time.perf_counter()
    cents, valid, _, _ = kmeans_compiled.kmeans_groups(*args, normalize=False, max_iter=max_iter, tol=tol)
    wall = time.perf_counter() - t0
    inertia = []
    for x, c, v in zip(problems, cents, valid):
        d = ((x[:, None, :] - c[None, v, :]) ** 2).sum(-1)
        inertia.append(float(d.min(1).sum()))
    return wall, np.array(inertia)


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
    # Ratios only where scikit-learn's inertia is not ~0 (a 2-point problem with K=2 has 0).
    big = sk > 1e-6
    rows = [("mars_plugin batched_kmeans, torch (n_init=1)", t_ours, res.inertia.numpy())]
    if kmeans_compiled.available():
        t_c, inertia_c = compiled_inertia(problems, args.k)
        rows.append(("mars_plugin compiled kernel (n_init=1)", t_c, inertia_c))
    print(f"machine: {platform.processor() or platform.machine()}, cpus={os.cpu_count()}, "
          f"torch threads={torch.get_num_threads()}, device=cpu, torch {torch.__version__}")
    print(f"{args.problems} problems, <= {args.points} points, D={args.dim}, K={args.k}")
    print("| method | wall s | problems/s | speed-up vs scikit-learn | inertia / sklearn: median | max |")
    print("| --- | --- | --- | --- | --- | --- |")
    for label, wall, inertia in rows:
        ratio = inertia[big] / sk[big]
        print(f"| {label} | {wall:.3f} | {args.problems / wall:.0f} | {t_sk / wall:.1f}x | "
              f"{np.median(ratio):.5f} | {ratio.max():.5f} |")
    print(f"| scikit-learn KMeans(n_init=10) per problem | {t_sk:.3f} | {args.problems / t_sk:.0f} | 1x | 1 | 1 |")


if __name__ == "__main__":
    main()
