"""Images per second of the dense CRF at 500x375 (a VOC image), 10 mean-field iterations.

For each preset (mars: Gaussian 1/3, bilateral 67/3/4; psa: 3/3, 80/13/10) and label count
(2: the debiased mask of Eq. 5; 21: VOC's classes):

* pydensecrf (the reference; the ``crf`` extra), one process, and --processes processes each
  running its share of the images (multiprocessing, one thread each);
* ours (mars_plugin.engines.crf.dense_crf) on the CPU with one thread (per core: compare with one
  pydensecrf process), at batch 1 and 8 with torch's threads (see the machine line; a batch runs
  its images in parallel threads), and on CUDA at batch 1, 16 and 64 when a GPU is there.

Images are generated (smooth colour fields, a few sharp-edged shapes, mild noise: a lattice of
the size natural images give), probabilities are a smooth random field. Ours is the median of
--repeats runs after a warm-up; the reference is timed once per image set. Also prints how far
ours is from the reference on these images (max |Q - Q_ref|, argmax agreement).

    python benchmarks/bench_crf.py [--images 8] [--presets mars,psa] [--labels 2,21] [--processes 2]

``--busy N`` starts N CPU-bound processes (``while 1: pass``) for the whole measurement: the
numbers on a machine whose cores are shared (the load average is printed at the end).

``--memory`` prints peak memory instead: bytes per pixel of one image's CRF, ours (torch, CPU)
and pydensecrf, at 500x375 and 1500x1000 (``--memory-sizes``), 2 and 21 labels, each run in a
fresh process whose peak-RSS counter is reset right before the call (Linux
``/proc/self/clear_refs``; the inputs and torch itself are not counted), median and range of
``--repeats`` processes, with ours over pydensecrf and ``crf_memory_bytes`` (what ``max_bytes``
is compared with):

    python benchmarks/bench_crf.py --memory [--memory-sizes 500x375,1500x1000] [--repeats 3]
"""
import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin.engines.crf import dense_crf  # noqa: E402
from mars_plugin.engines.crf_params import CRF_PRESETS  # noqa: E402


def natural_image(H: int, W: int, seed: int) -> np.ndarray:
    """Smooth colour fields + six sharp-edged ellipses with a shading gradient + noise (uint8)."""
    r = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:H, 0:W].astype(np.float32)
    img = np.zeros((H, W, 3), np.float32)
    for c in range(3):
        a, b, ph = r.uniform(0.005, 0.03), r.uniform(0.005, 0.03), r.uniform(0, 6)
        img[..., c] = 128 + 60 * np.sin(a * xx + ph) * np.cos(b * yy)
    for _ in range(6):
        cy, cx = r.uniform(0, H), r.uniform(0, W)
        ry, rx = r.uniform(H / 10, H / 3), r.uniform(W / 10, W / 3)
        m = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 < 1
        img[m] = r.uniform(0, 255, 3) + 20 * (yy[m, None] - cy) / ry
    img += r.normal(0, 4, img.shape)
    return np.clip(img, 0, 255).round().astype(np.uint8)


def smooth_probs(L: int, H: int, W: int, seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    logits = F.interpolate(torch.randn(1, L, H // 16 + 1, W // 16 + 1, generator=g) * 3, size=(H, W),
                           mode="bilinear", align_corners=False)[0]
    return logits.softmax(0).numpy().astype(np.float32)


def _reference(args):
    probs, img, params = args
    return dense_crf(probs, img, params, backend="pydensecrf").numpy()


def time_reference(probs, imgs, params, pool):
    """Seconds for the reference over all images, in this process or in ``pool``."""
    t0 = time.perf_counter()
    if pool is None:
        out = [_reference((p, i, params)) for p, i in zip(probs, imgs)]
    else:
        out = pool.map(_reference, [(p, i, params) for p, i in zip(probs, imgs)], chunksize=1)
    return time.perf_counter() - t0, out


def time_ours(probs, imgs, params, batch, device, threads=None):
    """Seconds for ours over all images, ``batch`` at a time (with ``threads`` CPU threads)."""
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _time_ours(probs, imgs, params, batch, device)
    finally:
        torch.set_num_threads(before)


def _time_ours(probs, imgs, params, batch, device):
    P = [torch.from_numpy(p).to(device) for p in probs]
    Im = [torch.from_numpy(i).to(device) for i in imgs]
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = []
    for s in range(0, len(P), batch):
        if batch == 1:
            out.append(dense_crf(P[s], Im[s], params))
        else:
            out.extend(dense_crf(torch.stack(P[s:s + batch]), torch.stack(Im[s:s + batch]), params).unbind(0))
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, [q.cpu().numpy() for q in out]


def _peak_one(backend: str, H: int, W: int, L: int, preset: str) -> int:
    """Peak RSS growth (bytes) of one dense CRF call, measured in this (fresh) process."""
    img = natural_image(H, W, 0)
    probs = torch.from_numpy(smooth_probs(L, H, W, 0))
    dense_crf(probs[:, :8, :8].contiguous(), img[:8, :8].copy(), preset, backend=backend)  # imports, warm-up

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) becomes the current RSS
    before = status("VmRSS")
    q = dense_crf(probs, img, preset, backend=backend)
    grow = status("VmHWM") - before
    del q
    return grow


def memory_table(args) -> None:
    from mars_plugin.engines.crf_memory import crf_memory_bytes

    print(machine_line("cpu"))
    print(f"peak RSS growth of one dense CRF call, bytes per pixel, {args.repeats} fresh processes each: median "
          "[range]; ours / pydensecrf from the medians; model = crf_memory_bytes")
    print("| image | preset | labels | ours B/px | pydensecrf B/px | ours / pydensecrf | model B/px |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                        os.environ.get("PYTHONPATH", "")]))
    backends = ["torch"] + (["pydensecrf"] if args.reference else [])
    for size in args.memory_sizes.split(","):
        W, H = (int(x) for x in size.split("x"))
        for preset in args.presets.split(","):
            for L in (int(x) for x in args.labels.split(",")):
                got = {b: [] for b in backends}
                for _ in range(args.repeats):
                    for b in backends:  # interleaved: the machine's state hits both alike
                        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--peak-one",
                                            f"{b},{H},{W},{L},{preset}"], capture_output=True, text=True, env=env)
                        if r.returncode:
                            raise SystemExit(f"{b} {W}x{H} {preset} {L}: exit {r.returncode}\n{r.stderr[-2000:]}")
                        got[b].append(json.loads(r.stdout.strip().splitlines()[-1]) / (H * W))
                med = {b: float(np.median(v)) for b, v in got.items()}
                cell = {b: f"{med[b]:.0f} [{min(v):.0f}-{max(v):.0f}]" for b, v in got.items()}
                ratio = f"{med['torch'] / med['pydensecrf']:.2f}" if "pydensecrf" in med else "-"
                model = crf_memory_bytes(H, W, L, preset) / (H * W)
                print(f"| {W}x{H} | {preset} | {L} | {cell['torch']} | {cell.get('pydensecrf', '-')} | {ratio} | "
                      f"{model:.0f} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=8, help="images per measurement (repeated to fill a batch)")
    ap.add_argument("--height", type=int, default=375)
    ap.add_argument("--width", type=int, default=500)
    ap.add_argument("--presets", default="mars,psa")
    ap.add_argument("--labels", default="2,21")
    ap.add_argument("--processes", type=int, default=os.cpu_count(), help="processes of the parallel reference")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each times every method once, in turn")
    ap.add_argument("--cuda-batches", default="1,16,64")
    ap.add_argument("--no-reference", dest="reference", action="store_false")
    ap.add_argument("--memory", action="store_true", help="print peak memory per pixel instead of speed")
    ap.add_argument("--memory-sizes", default="500x375,1500x1000", help="WxH images of --memory")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per --memory measurement")
    ap.add_argument("--busy", type=int, default=0, help="CPU-bound processes running during the measurement")
    ap.add_argument("--peak-one", default=None, help=argparse.SUPPRESS)  # backend,H,W,L,preset: one measurement
    args = ap.parse_args()
    if args.peak_one:
        b, H, W, L, preset = args.peak_one.split(",")
        print(json.dumps(_peak_one(b, int(H), int(W), int(L), preset)))
        return
    try:
        import pydensecrf  # noqa: F401
    except ImportError:
        args.reference = False
    if args.memory:
        memory_table(args)
        return
    cuda = torch.cuda.is_available()
    print(machine_line("cuda" if cuda else "cpu"))
    print(f"{args.images} images of {args.width}x{args.height}, 10 iterations; images/s, median of {args.rounds} "
          "rounds (each round runs every method once, in turn, so that the machine's load hits all alike); "
          "ratio = ours / single-process pydensecrf within a round, median")
    print("| preset | labels | method | images/s | ratio to pydensecrf, 1 process | max abs diff to pydensecrf "
          "| argmax agreement |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    H, W = args.height, args.width
    imgs = [natural_image(H, W, s) for s in range(args.images)]
    pool = None
    if args.reference and args.processes > 1:
        pool = mp.get_context("spawn").Pool(args.processes, initializer=torch.set_num_threads, initargs=(1,))
    methods = []
    if args.reference:
        methods += [("pydensecrf, 1 process", "ref", None)]
        if pool is not None:
            methods += [(f"pydensecrf, {args.processes} processes", "ref", pool)]
    methods += [("ours, cpu, 1 thread, batch 1", "cpu1", 1)]
    methods += [(f"ours, cpu, batch {b}", "cpu", b) for b in (1, 8)]
    if cuda:
        methods += [(f"ours, cuda, batch {b}", "cuda", int(b)) for b in args.cuda_batches.split(",")]
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(args.busy)]
    loads = []
    try:
        for preset in args.presets.split(","):
            params = CRF_PRESETS[preset]
            for L in (int(x) for x in args.labels.split(",")):
                probs = [smooth_probs(L, H, W, s) for s in range(args.images)]
                times = {name: [] for name, _, _ in methods}
                outs = {}
                for r in range(args.rounds + 1):  # round 0 warms up (threads, pools, CUDA)
                    for name, kind, arg in methods:
                        if kind == "ref":
                            if r == 0 and arg is None:
                                continue
                            t, out = time_reference(probs, imgs, params, arg)
                            n = len(probs)
                        else:
                            n = max(arg, len(probs)) // arg * arg
                            reps = n // len(probs) + 1
                            t, out = time_ours((probs * reps)[:n], (imgs * reps)[:n], params, arg,
                                               "cpu" if kind == "cpu1" else kind, 1 if kind == "cpu1" else None)
                        loads.append(os.getloadavg()[0])
                        if r > 0:
                            times[name].append(n / t)
                            outs[name] = out[: len(probs)]
                ref = outs.get("pydensecrf, 1 process")
                for name, kind, _ in methods:
                    rate = float(np.median(times[name]))
                    ratio = "-"
                    if ref is not None:
                        ratio = f"{float(np.median(np.array(times[name]) / np.array(times['pydensecrf, 1 process']))):.2f}"
                    cmp = "- | -"
                    if ref is not None and kind != "ref":
                        diff = max(float(np.abs(a - b).max()) for a, b in zip(outs[name], ref))
                        agree = float(np.mean([(a.argmax(0) == b.argmax(0)).mean() for a, b in zip(outs[name], ref)]))
                        cmp = f"{diff:.1e} | {100 * agree:.3f}%"
                    print(f"| {preset} | {L} | {name} | {rate:.2f} | {ratio} | {cmp} |", flush=True)
        print(f"{args.busy} busy processes; load average {min(loads):.1f}-{max(loads):.1f} while measuring")
    finally:
        for p in busy:
            p.kill()
        if pool is not None:
            pool.close()
            pool.join()


if __name__ == "__main__":
    main()
