"""How close the pydensecrf drop-in (``mars_plugin.densecrf``) comes to pydensecrf itself, over a
wide sweep: image sizes from 8x8 to 375x500, 2 to 21 labels (and 1 and 182), every CRF preset
of :data:`mars_plugin.engines.crf_params.CRF_PRESETS` and every upstream helper's settings and
unary (deeplab-pytorch, RS+EPM's ``bg_th`` and ``gamma`` backgrounds, DHR's ``for_seg`` with and
without ``gamma``, their ``run_label``, IRNet's ``crf_inference_label``, SEAM/PSA's
``crf_inference`` at t 10 and 1 and scale 1 and 0.5), on photograph-like images (scikit-learn's
two photographs where installed, else smooth synthetic ones), smooth synthetic images, noise,
and images with their left or right half darkened.

Each case runs the same calls on both modules and compares Q: the largest |dQ|, the values of Q
that differ at all, and the pixels whose argmax label differs. The summary prints the largest
|dQ| over all cases (and its case), the share of equal labels, and how many cases were equal bit
for bit. ``tests/test_crf_exactness_sweep.py`` runs a small sweep of the same cases (``quick``).

    python benchmarks/crf_exactness_sweep.py [--quick] [--no-numba] [--verbose]

``--no-numba`` measures the torch lattice (``MARS_NO_NUMBA=1``: the drop-in without the ``fast``
extra), which keeps the fixed-pair CRF's folded arithmetic and so differs in the last bits.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Callable, Dict, Iterator, List, Tuple

import numpy as np

OURS = ("mars_plugin.densecrf", "mars_plugin.densecrf.utils")
REFERENCE = ("pydensecrf.densecrf", "pydensecrf.utils")

# name -> (Gaussian sxy, compat, bilateral sxy, srgb, compat, iterations): the presets and the
# helpers' own settings (each helper's file and lines: tests/test_densecrf_upstream.py).
SETTINGS: Dict[str, Tuple[float, float, float, float, float, int]] = {
    "deeplab": (1, 3, 67, 3, 4, 10),  # deeplab-pytorch voc12.yaml; RS+EPM, DHR; preset mars
    "psa": (3, 3, 80, 13, 10, 10),  # PSA/SEAM crf_inference t=10; preset psa
    "seam-t1": (3, 3, 80, 13, 10, 1),  # SEAM infer_aff.py t=1
    "seam-half": (6, 3, 160, 13, 10, 10),  # SEAM scale_factor 0.5
    "seam-seg": (3, 3, 32, 13, 10, 1),  # preset seam-seg
    "irnet": (3, 3, 50, 5, 10, 10),  # IRNet/AdvCAM crf_inference_label; preset irnet
}


# ------------------------------------------------------------------------------------ images
def _fields(n: int, H: int, W: int, rng: np.random.Generator, cell: int = 12) -> np.ndarray:
    """(n, H, W) float64 smooth random fields (a coarse grid, bilinearly upsampled)."""
    gh, gw = H // cell + 2, W // cell + 2
    g = rng.normal(size=(n, gh, gw))
    ys, xs = np.linspace(0, gh - 1.001, H), np.linspace(0, gw - 1.001, W)
    y0, x0 = ys.astype(int), xs.astype(int)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    a, b = g[:, y0][:, :, x0], g[:, y0][:, :, x0 + 1]
    c, d = g[:, y0 + 1][:, :, x0], g[:, y0 + 1][:, :, x0 + 1]
    return a * (1 - fy) * (1 - fx) + b * (1 - fy) * fx + c * fy * (1 - fx) + d * fy * fx


def _photo(index: int, H: int, W: int, seed: int) -> np.ndarray:
    """scikit-learn's photograph ``index`` resized to H x W (a smooth synthetic image without it)."""
    try:
        from PIL import Image
        from sklearn.datasets import load_sample_images
        full = load_sample_images().images[index]
        return np.asarray(Image.fromarray(full).resize((W, H), Image.BILINEAR))
    except ImportError:  # pragma: no cover - scikit-learn or Pillow missing
        return _smooth(H, W, seed)


def _smooth(H: int, W: int, seed: int) -> np.ndarray:
    f = _fields(3, H, W, np.random.default_rng(seed), cell=max(2, min(H, W) // 4))
    return np.clip(128 + 60 * f, 0, 255).transpose(1, 2, 0)


def image(kind: str, H: int, W: int, seed: int) -> np.ndarray:
    """(H, W, 3) uint8 C-contiguous: ``photo0``/``photo1``, ``smooth``, ``noise``, each with
    ``-left``/``-right`` for that half darkened (divided by 4)."""
    base, _, half = kind.partition("-")
    if base.startswith("photo"):
        img = _photo(int(base[5:]), H, W, seed)
    elif base == "smooth":
        img = _smooth(H, W, seed)
    else:
        img = np.random.default_rng(seed).integers(0, 256, (H, W, 3))
    img = np.array(img, dtype=np.uint8, order="C")
    if half == "left":
        img[:, : W // 2] //= 4
    elif half == "right":
        img[:, W // 2:] //= 4
    return img


# ------------------------------------------------------------------------------------ unaries
def probabilities(kind: str, L: int, H: int, W: int, seed: int) -> np.ndarray:
    """(L, H, W) float32 inputs of unary_from_softmax, as each helper builds them:
    ``softmax`` (a network's output: a few present classes), ``uniform`` (normalised uniform
    noise), ``noise`` (its cube: peaked),
    ``bg_th`` (RS+EPM: 0.3 background before L-1 max-normalised CAMs), ``gamma`` (RS+EPM and
    DHR without for_seg: (1 - max)^2 background), ``for_seg`` (DHR: p[0] ** 2, not renormalised)."""
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        p = rng.random((L, H, W))
        return (p / p.sum(0)).astype(np.float32)
    if kind == "noise":
        p = rng.random((L, H, W)) ** 3 + 1e-6
        return (p / p.sum(0)).astype(np.float32)
    if kind in ("softmax", "for_seg"):
        logits = np.full((L, H, W), -6.0) + 0.5 * _fields(L, H, W, rng)
        keep = np.concatenate([[0], rng.choice(np.arange(1, L), size=min(3, L) - 1, replace=False)])
        logits[keep] = 4.0 * _fields(len(keep), H, W, rng)
        e = np.exp(logits - logits.max(0, keepdims=True))
        p = e / e.sum(0, keepdims=True)
        if kind == "for_seg":
            p[0] = p[0] ** 2
        return p.astype(np.float32)
    cams = np.maximum(_fields(max(L - 1, 1), H, W, rng), 0)
    cams = cams / np.maximum(cams.reshape(len(cams), -1).max(1), 1e-6)[:, None, None]
    bg = np.full((1, H, W), 0.3) if kind == "bg_th" else (1 - cams.max(0, keepdims=True)) ** 2
    return np.ascontiguousarray(np.concatenate([bg, cams])[:L], dtype=np.float32)


def run(mods, img: np.ndarray, unary_kind: str, data: np.ndarray, L: int, setting: str) -> np.ndarray:
    """The helper's calls on module pair ``mods``: Q (L, H*W) float32."""
    dcrf, utils = mods
    H, W = img.shape[:2]
    sg, cg, sb, sr, cb, iters = SETTINGS[setting]
    d = dcrf.DenseCRF2D(W, H, L)
    if unary_kind == "labels":  # run_label / crf_inference_label
        d.setUnaryEnergy(np.ascontiguousarray(utils.unary_from_labels(data, L, gt_prob=0.7, zero_unsure=False)))
    else:
        d.setUnaryEnergy(np.ascontiguousarray(utils.unary_from_softmax(data)))
    d.addPairwiseGaussian(sxy=sg, compat=cg)
    d.addPairwiseBilateral(sxy=sb, srgb=sr, rgbim=img, compat=cb)
    return np.array(d.inference(iters))


Case = Tuple[str, str, int, int, int, str, str, int]  # setting, image, L, H, W, unary, probs, seed


def compare(case: Case) -> Dict[str, float]:
    """One case on both modules: max |dQ|, values of Q that differ, pixels, differing labels."""
    setting, img_kind, L, H, W, unary_kind, prob_kind, seed = case
    img = image(img_kind, H, W, seed)
    if unary_kind == "labels":
        data = probabilities("softmax", max(L, 2), H, W, seed).argmax(0) % L
    else:
        data = probabilities(prob_kind, L, H, W, seed)
    mods = [tuple(importlib.import_module(m) for m in pair) for pair in (REFERENCE, OURS)]
    ref, ours = (run(m, img, unary_kind, data, L, setting) for m in mods)
    return {"max_dq": float(np.abs(ref - ours).max()), "values_differ": int((ref != ours).sum()),
            "pixels": H * W, "labels_differ": int((ref.argmax(0) != ours.argmax(0)).sum())}


# ------------------------------------------------------------------------------------ the sweep
def quick_cases() -> List[Case]:
    """The test's sweep: both cases of the issue, and one case of each setting, unary and image
    kind at small sizes."""
    return [
        # the two: psa settings, 21 labels, 75x50, half-darkened noise (4.6e-4 before);
        # DHR for_seg gamma=2 on a photograph, 2 labels (2.0e-6 before)
        ("psa", "noise-right", 21, 75, 50, "softmax", "uniform", 11),
        ("deeplab", "photo1", 2, 120, 160, "softmax", "for_seg", 2),
        ("deeplab", "photo0", 2, 60, 80, "softmax", "gamma", 1),
        ("deeplab", "smooth-right", 5, 13, 17, "softmax", "bg_th", 3),
        ("irnet", "photo0", 3, 40, 30, "labels", "", 4),
        ("deeplab", "noise", 21, 24, 24, "labels", "", 5),
        ("seam-t1", "photo1-left", 21, 30, 40, "softmax", "softmax", 6),
        ("seam-half", "smooth", 4, 8, 8, "softmax", "noise", 7),
        ("seam-seg", "noise-right", 9, 20, 12, "softmax", "softmax", 8),
        ("deeplab", "photo1", 1, 16, 16, "softmax", "noise", 9),
    ]


def full_cases() -> Iterator[Case]:
    """The wide sweep: every setting x image kind x label count at small and medium sizes,
    then the helpers' photographs at 375x500."""
    yield from quick_cases()
    sizes = [(8, 8), (13, 17), (50, 75), (75, 50), (120, 160)]
    images = ["photo0", "photo1", "smooth", "noise", "noise-left", "noise-right", "photo0-left", "smooth-right"]
    seed = 100
    for setting in SETTINGS:
        for i, img_kind in enumerate(images):
            for j, L in enumerate((2, 3, 5, 8, 13, 21)):
                H, W = sizes[(i + j) % len(sizes)]
                unary, probs = [("softmax", "softmax"), ("softmax", "noise"), ("softmax", "gamma"),
                                ("softmax", "for_seg"), ("labels", ""), ("softmax", "bg_th")][(i + 2 * j) % 6]
                seed += 1
                yield setting, img_kind, L, H, W, unary, probs, seed
    for setting, L, unary, probs in (("deeplab", 21, "softmax", "softmax"), ("deeplab", 2, "softmax", "for_seg"),
                                     ("deeplab", 182, "softmax", "softmax"), ("irnet", 21, "labels", ""),
                                     ("psa", 21, "softmax", "softmax"), ("deeplab", 2, "softmax", "gamma")):
        for img_kind in ("photo0", "photo1"):
            seed += 1
            yield setting, img_kind, L, 375, 500, unary, probs, seed


def sweep(cases, verbose: bool = False) -> Dict[str, object]:
    """Run ``cases``; the summary: cases, bit-equal cases, largest |dQ| and its case, pixels,
    equal labels' share."""
    worst, worst_case, pixels, differ, equal_cases, n = 0.0, None, 0, 0, 0, 0
    for case in cases:
        r = compare(case)
        n += 1
        pixels += r["pixels"]
        differ += r["labels_differ"]
        equal_cases += r["values_differ"] == 0
        if r["max_dq"] > worst:
            worst, worst_case = r["max_dq"], case
        if verbose:
            print(f"{case}: max|dQ| {r['max_dq']:.3g}, {r['values_differ']} values differ, "
                  f"{r['labels_differ']} labels differ", flush=True)
    return {"cases": n, "bit_equal_cases": equal_cases, "max_dq": worst, "worst_case": worst_case,
            "pixels": pixels, "labels_differ": differ, "equal_label_share": 1.0 - differ / max(pixels, 1)}


def main(argv: List[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the test's small sweep only")
    ap.add_argument("--no-numba", action="store_true", help="the torch lattice (MARS_NO_NUMBA=1)")
    ap.add_argument("--verbose", action="store_true", help="one line per case")
    args = ap.parse_args(argv)
    if args.no_numba:
        os.environ["MARS_NO_NUMBA"] = "1"
    t0 = time.time()
    s = sweep(quick_cases() if args.quick else full_cases(), args.verbose)
    print(f"engine: {'torch lattice' if args.no_numba else 'compiled (numba)'}; {s['cases']} cases, "
          f"{s['pixels']:,} pixels, {time.time() - t0:.0f} s")
    where = f" (case {s['worst_case']})" if s["worst_case"] else ""
    print(f"max |dQ| {s['max_dq']:.3g}{where}; Q equal bit for bit in {s['bit_equal_cases']} "
          f"of {s['cases']} cases; labels equal on {s['pixels'] - s['labels_differ']:,} of {s['pixels']:,} "
          f"pixels ({100 * s['equal_label_share']:.4f}%)")


if __name__ == "__main__":
    main(sys.argv[1:])
