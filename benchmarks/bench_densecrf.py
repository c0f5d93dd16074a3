"""The pydensecrf drop-in (``mars_plugin.densecrf``) against pydensecrf itself, per CPU core.

Each codebase's own call (the helpers of tests/test_densecrf_upstream.py), on 500x375 crops of
scikit-learn's two photographs, 10 mean-field iterations:

* deeplab-pytorch (libs/utils/crf.py, configs/voc12.yaml): ``unary_from_softmax``, Gaussian
  sxy 1 compat 3, bilateral sxy 67 srgb 3 compat 4; 1, 2 and 21 labels;
* IRNet/AdvCAM (misc/imutils.py ``crf_inference_label``): ``unary_from_labels(gt_prob=0.7,
  zero_unsure=False)``, Gaussian 3/3, bilateral 50/5/10; 2 and 21 labels (IRNet's n_labels is
  the image's classes + background, never 1).

Per core: torch.set_num_threads(1), NUMBA_NUM_THREADS=1 and OMP_NUM_THREADS=1 are set before
anything is imported (pydensecrf itself runs one thread). Each round times both modules in
turn on every image (the machine's load hits both alike); images/s is the median of --rounds
rounds after a warm-up round, the ratio ours / pydensecrf is taken within each round, then the
median. The machine line and the load average while measuring are printed.

``--device cuda`` adds the drop-in on CUDA (``DenseCRF2D(W, H, L, device="cuda")``, one image
per object, as an unchanged codebase calls it), at ``--cuda-labels`` (default 21 and 81).

    python benchmarks/bench_densecrf.py [--labels 1,2,21] [--rounds 5] [--device cuda] [--no-reference]
"""
import os

for _var in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS"):  # per core, before numpy/numba load
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import importlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402
from bench_crf import natural_image, smooth_probs  # noqa: E402


def photos(H: int, W: int):
    """Centre crops of scikit-learn's china.jpg and flower.jpg (generated images without it)."""
    try:
        from sklearn.datasets import load_sample_images
    except ImportError:  # a bare GPU machine
        return [natural_image(H, W, s) for s in range(2)], "generated images (no scikit-learn)"
    out = []
    for full in load_sample_images().images:
        y, x = (full.shape[0] - H) // 2, (full.shape[1] - W) // 2
        out.append(np.array(full[y:y + H, x:x + W], dtype=np.uint8, order="C"))
    return out, "china.jpg and flower.jpg"


def deeplab_pytorch(mods, image, probmap, device=None):
    """kazuto1011/deeplab-pytorch@4219467 libs/utils/crf.py:23-41, configs/voc12.yaml:52-58."""
    dcrf, utils = mods
    C, H, W = probmap.shape
    d = dcrf.DenseCRF2D(W, H, C) if device is None else dcrf.DenseCRF2D(W, H, C, device=device)
    d.setUnaryEnergy(np.ascontiguousarray(utils.unary_from_softmax(probmap)))
    d.addPairwiseGaussian(sxy=1, compat=3)
    d.addPairwiseBilateral(sxy=67, srgb=3, rgbim=image, compat=4)
    return np.array(d.inference(10)).reshape((C, H, W))


def irnet(mods, image, labels, n_labels, device=None):
    """jiwoon-ahn/irn@a2ece00 misc/imutils.py:156-170 crf_inference_label (Q before its argmax)."""
    dcrf, utils = mods
    h, w = image.shape[:2]
    d = dcrf.DenseCRF2D(w, h, n_labels) if device is None else dcrf.DenseCRF2D(w, h, n_labels, device=device)
    d.setUnaryEnergy(utils.unary_from_labels(labels, n_labels, gt_prob=0.7, zero_unsure=False))
    d.addPairwiseGaussian(sxy=3, compat=3)
    d.addPairwiseBilateral(sxy=50, srgb=5, rgbim=image, compat=10)
    return np.array(d.inference(10)).reshape((n_labels, h, w))


def inputs(setting: str, L: int, imgs):
    """Per image: (call, args) of the setting at L labels (CAM-like smooth probabilities)."""
    H, W = imgs[0].shape[:2]
    runs = []
    for s, img in enumerate(imgs):
        probs = smooth_probs(L, H, W, s)
        if setting == "deeplab-pytorch":
            runs.append((deeplab_pytorch, (img, probs)))
        else:
            runs.append((irnet, (img, probs.argmax(0).astype(np.int64), L)))
    return runs


def time_runs(mods, runs, device=None):
    """Seconds for all images, and their Q."""
    out = []
    t0 = time.perf_counter()
    for fn, args in runs:
        out.append(fn(mods, *args, device=device) if device else fn(mods, *args))
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--labels", default="1,2,21", help="label counts of the CPU rows ('' for none)")
    ap.add_argument("--settings", default="deeplab-pytorch,irnet")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU rows of the drop-in")
    ap.add_argument("--cuda-labels", default="21,81")
    ap.add_argument("--no-reference", dest="reference", action="store_false")
    args = ap.parse_args()
    torch.set_num_threads(1)
    ours = (importlib.import_module("mars_plugin.densecrf"), importlib.import_module("mars_plugin.densecrf.utils"))
    ref = None
    if args.reference:
        try:
            ref = (importlib.import_module("pydensecrf.densecrf"), importlib.import_module("pydensecrf.utils"))
        except ImportError:
            print("pydensecrf (the crf extra) is not installed: the drop-in alone")
    imgs, what = photos(args.height, args.width)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_densecrf.py: --device cuda but torch.cuda.is_available() is False: no CUDA rows")
        cuda = False
    print(machine_line("cuda" if cuda else "cpu"))
    print(f"{what}, {args.width}x{args.height}, 10 iterations, {len(imgs)} images a round; images/s per core "
          f"(1 thread), median of {args.rounds} rounds after a warm-up; ratio = ours / pydensecrf within a round, "
          "median; Q compared with pydensecrf's")
    print("| setting | labels | device | pydensecrf images/s | ours images/s | ours / pydensecrf | max abs diff of Q "
          "| argmax agreement |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    loads = [os.getloadavg()[0]]
    rows = [(s, int(L), "cpu") for s in args.settings.split(",") for L in args.labels.split(",") if L]
    if cuda:
        rows += [(s, int(L), "cuda") for s in args.settings.split(",") for L in args.cuda_labels.split(",") if L]
    for setting, L, device in rows:
        if setting == "irnet" and L < 2:
            continue  # unary_from_labels divides by n_labels - 1; IRNet always has background + a class
        runs = inputs(setting, L, imgs)
        use_ref = ref is not None and device == "cpu"
        dev = None if device == "cpu" else device
        t_ours, t_ref, ratio = [], [], []
        for r in range(args.rounds + 1):  # round 0 warms up (numba's compile, CUDA kernels)
            t, q_ours = time_runs(ours, runs, dev)
            if use_ref:
                tr, q_ref = time_runs(ref, runs)
            loads.append(os.getloadavg()[0])
            if r:
                t_ours.append(len(runs) / t)
                if use_ref:
                    t_ref.append(len(runs) / tr)
                    ratio.append(tr / t)
        cmp, ref_cell, ratio_cell = "- | -", "-", "-"
        if use_ref:
            diff = max(float(np.abs(a - b).max()) for a, b in zip(q_ours, q_ref))
            agree = np.mean([(a.argmax(0) == b.argmax(0)).mean() for a, b in zip(q_ours, q_ref)])
            cmp = f"{diff:.1e} | {100 * agree:.3f}%"
            ref_cell, ratio_cell = f"{statistics.median(t_ref):.2f}", f"{statistics.median(ratio):.2f}"
        print(f"| {setting} | {L} | {device} | {ref_cell} | {statistics.median(t_ours):.2f} | {ratio_cell} | {cmp} |",
              flush=True)
    print(f"load average {min(loads):.1f}-{max(loads):.1f} while measuring (os.getloadavg, 1 min)")


if __name__ == "__main__":
    main()
