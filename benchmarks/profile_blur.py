"""The lattice blur's row gathers on a GPU, one bilateral lattice of B x S x S photograph-like
pixels (mars preset), L labels: the code's index_select vs alternatives (int64 indices, a
transposed (L, M) layout, torch.gather, one fused index for the two neighbours). Not a test.

    python benchmarks/profile_blur.py [--batch 16 --size 512 --labels 4]
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_crf import natural_image  # noqa: E402

from mars_plugin.engines.crf_lattices import _features, _lattice, _segments  # noqa: E402
from mars_plugin.engines.crf_params import CRF_PRESETS  # noqa: E402


def t(fn, reps=10):
    fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    return (time.perf_counter() - t0) / reps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--labels", type=int, default=4)
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    p = CRF_PRESETS["mars"]
    rgbs = [torch.from_numpy(natural_image(a.size, a.size, b)).to(dev) for b in range(a.batch)]
    shapes = tuple((a.size, a.size) for _ in rgbs)
    feats = _features(shapes, p["bilateral_sxy"], rgbs, p["bilateral_srgb"], dev)
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    lat = _lattice(feats, _segments([a.size * a.size] * a.batch, dev))
    torch.cuda.synchronize() if torch.cuda.is_available() else None
    build = (time.perf_counter() - t0) * 1e3
    N = feats.shape[0]
    M = lat._blur[0][0].shape[0]
    print(f"N = {N:,} pixels, M + 1 = {M:,} lattice points ({M / N:.2f} per pixel), d = {lat.dim}; build {build:.1f} ms")
    v = torch.rand(N, a.labels, device=dev)
    print(f"filter (whole): {t(lambda: lat.filter(v)):.2f} ms")
    w = torch.rand(M, a.labels, device=dev)
    n1, n2 = lat._blur[0]
    out = torch.empty_like(w)
    print(f"index_select (M, L) int32 idx: {t(lambda: torch.index_select(w, 0, n1, out=out)):.3f} ms")
    n1l = n1.long()
    print(f"index_select (M, L) int64 idx: {t(lambda: torch.index_select(w, 0, n1l, out=out)):.3f} ms")
    print(f"w[n1l] advanced indexing: {t(lambda: w[n1l]):.3f} ms")
    wt = w.t().contiguous()
    outt = torch.empty_like(wt)
    print(f"index_select (L, M) dim 1 int64: {t(lambda: torch.index_select(wt, 1, n1l, out=outt)):.3f} ms")
    g = n1l[:, None].expand(-1, a.labels)
    print(f"torch.gather (M, L): {t(lambda: torch.gather(w, 0, g, out=out)):.3f} ms")
    w4 = torch.rand(M, 4, device=dev)
    print(f"index_select (M, 4) int64: {t(lambda: torch.index_select(w4, 0, n1l)):.3f} ms")
    w1 = torch.rand(M, device=dev)
    print(f"index_select (M,) 1-D int64: {t(lambda: torch.index_select(w1, 0, n1l)):.3f} ms")
    print(f"sorted-index gather (locality bound): {t(lambda: torch.index_select(w, 0, torch.sort(n1l).values)):.3f} ms")
    print(f"copy (M, L) (bandwidth bound): {t(lambda: out.copy_(w)):.3f} ms")
    wh = w.half()
    print(f"index_select (M, L) fp16 int64: {t(lambda: torch.index_select(wh, 0, n1l)):.3f} ms")


if __name__ == "__main__":
    main()
