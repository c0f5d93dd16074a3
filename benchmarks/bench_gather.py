"""Does the dense CRF's blur hit a slow gather at 21 and 81 labels? The gather forms of torch on
the real neighbour tables of a photograph's lattices.

The permutohedral blur (mars_plugin/engines/permutohedral.py, ``PermutohedralLattice.filter``)
reads, per lattice axis, the two neighbours of every lattice point: two gathers of the (M+1, C)
values, C = the labels. It gathers rows along dim 0 (``index_select(v, 0, idx)``) on the CPU
and, on CUDA, along dim 1 of the transposed (C, M+1) copy (a public GPU lattice notes that the
row gather is 3-15x slower for C between 4 and 20). This prints, per C, ms per gather of one
real neighbour table of scikit-learn's china.jpg (500x375 crop) with deeplab-pytorch's settings
(the bilateral lattice 67/3, d = 5, and the Gaussian one 1, d = 2), for the equivalent forms:

* rows: ``index_select(v, 0, idx, out=)``, ``v[idx]``, ``gather(v, 0, idx expanded to (M, C))``,
  ``take_along_dim(v, idx[:, None], 0)``
* transposed (C, M+1) values: ``index_select(vt, 1, idx, out=)``, ``vt[:, idx]``,
  ``gather(vt, 1, idx expanded to (C, M))``

and the whole ``filter`` (splat, blur, slice) with the blur in either layout
(``TRANSPOSED_BLUR``), the transposes included. Median of --repeats, one thread by default (per
core). All forms return the same values (checked).

    python benchmarks/bench_gather.py [--channels 2,4,21,81] [--repeats 7] [--threads 1] [--device cpu]
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.engines import permutohedral  # noqa: E402
from mars_plugin.engines.crf_lattices import _features, _lattice  # noqa: E402


def photo_crop(H: int = 375, W: int = 500) -> np.ndarray:
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:  # a bare GPU machine: a generated image of the same kind
        from bench_crf import natural_image

        return natural_image(H, W, 0)

    full = load_sample_images().images[0]
    y, x = (full.shape[0] - H) // 2, (full.shape[1] - W) // 2
    return np.array(full[y:y + H, x:x + W], dtype=np.uint8, order="C")


def timed(fn, repeats: int, dev: str) -> float:
    """Median ms of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    out = []
    for _ in range(repeats):
        if dev == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev == "cuda":
            torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--channels", default="2,4,21,81")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = args.device
    img = photo_crop()
    H, W = img.shape[:2]
    print(machine_line(dev))
    loads = [os.getloadavg()[0]]
    for name, rgbs, sxy, srgb in (("bilateral 67/3 (d = 5)", [torch.from_numpy(img).to(dev)], 67.0, 3.0),
                                  ("Gaussian 1 (d = 2)", None, 1.0, 1.0)):
        lattice = _lattice(_features([(H, W)], sxy, rgbs, srgb, torch.device(dev)), None)
        table(lattice, f"china.jpg 500x375, {name} lattice", H * W, args, loads)
    print(f"load average {min(loads):.1f}-{max(loads):.1f} while measuring (os.getloadavg, 1 min)")


def table(lattice, what: str, N: int, args, loads) -> None:
    dev = args.device
    M1 = lattice.num_lattice_points + 1
    idx = lattice._blur[0][0].long()  # one axis's n1 table, as the blur uses it (int32 -> int64 once)
    idx32 = lattice._blur[0][0]
    print(f"\n{what}: N = {N:,} pixels, M + 1 = {M1:,} lattice points ({M1 / N:.2f} per pixel); ms per gather of one axis's neighbour table, median of {args.repeats}; "
          f"filter = splat + blur (2 gathers per axis) + slice, ms")
    print("| C | rows index_select | rows v[idx] | rows gather | rows take_along_dim | transposed index_select "
          "| transposed vt[:, idx] | transposed gather | filter, rows | filter, transposed (transposes included) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for C in (int(c) for c in args.channels.split(",")):
        g = torch.Generator(device="cpu").manual_seed(C)
        v = torch.rand(M1, C, generator=g).to(dev)
        vt = v.t().contiguous()
        w, wt = torch.empty_like(v), torch.empty_like(vt)
        rows_idx = idx[:, None].expand(M1, C)
        cols_idx = idx[None].expand(C, M1)
        forms = {
            "rows index_select": lambda: torch.index_select(v, 0, idx32, out=w),
            "rows v[idx]": lambda: v[idx],
            "rows gather": lambda: torch.gather(v, 0, rows_idx, out=w),
            "rows take_along_dim": lambda: torch.take_along_dim(v, idx[:, None], 0),
            "transposed index_select": lambda: torch.index_select(vt, 1, idx32, out=wt),
            "transposed vt[:, idx]": lambda: vt[:, idx],
            "transposed gather": lambda: torch.gather(vt, 1, cols_idx, out=wt),
        }
        want = v[idx]
        for name, fn in forms.items():
            got = fn()
            assert torch.equal(got if not name.startswith("transposed") else got.t(), want), name
        cells = [f"{timed(fn, args.repeats, dev):.2f}" for fn in forms.values()]
        q = torch.rand(N, C, generator=g).to(dev)
        filt = []
        for transposed in (False, True):
            permutohedral.TRANSPOSED_BLUR = transposed
            try:
                filt.append(timed(lambda: lattice.filter(q), max(3, args.repeats // 2), dev))
            finally:
                permutohedral.TRANSPOSED_BLUR = None
        loads.append(os.getloadavg()[0])
        print(f"| {C} | " + " | ".join(cells) + f" | {filt[0]:.1f} | {filt[1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
