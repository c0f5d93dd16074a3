"""`mars crf` (the folder job) images/s on synthetic 500x375 data: probability maps of L labels
(.npy, float16 as DHR stores its predictions) and their JPEG images, label PNGs out.

Two rows on the device asked (default the CPU): the whole job (read, CRF, write) at --batch-size,
and the I/O alone (the CRF replaced by an identity stub: what the reading, decoding, encoding and
writing cost) at --workers 0 and 2. Prints the measured numbers, the machine and the load
average (the CPU is shared: a load above the cores means the numbers are low).

    python benchmarks/bench_crf_job.py [--images 6] [--labels 21] [--device cpu] [--batch-size 4]
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _machine import machine_line  # noqa: E402

#: COCO 2014 val, the job users report: "CRF on COCO val took 30 hours with 16 workers".
COCO_VAL = 40137
REPORTED_HOURS, REPORTED_WORKERS = 30, 16


def make_folder(root: str, n: int, L: int, H: int = 375, W: int = 500) -> None:
    """``root/probs/<stem>.npy`` (L, H, W) float16 probabilities and ``root/images/<stem>.jpg``."""
    from PIL import Image
    from bench_crf import natural_image, smooth_probs

    os.makedirs(os.path.join(root, "probs"), exist_ok=True)
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    for i in range(n):
        np.save(os.path.join(root, "probs", f"img{i:05d}.npy"), smooth_probs(L, H, W, i % 8).astype(np.float16))
        Image.fromarray(natural_image(H, W, i % 8)).save(os.path.join(root, "images", f"img{i:05d}.jpg"), quality=90)


def _identity(maps, rgbs, params, max_bytes=None):
    """The CRF call replaced by a copy of its float32 inputs (the I/O rows): everything else of
    the job runs, the widening of float16 maps and the device's argmax included."""
    return [m.float().clone() for m in maps]


def time_job(root: str, out: str, *, device: str = "cpu", batch_size: int = 4, workers: int = 0,
             identity: bool = False, io_workers: int = 0) -> float:
    """Seconds of one `mars crf --probs` run into a new ``out`` (its own process state: the CRF
    stub only where asked: the CRF runs in this process, the --workers read and write)."""
    import mars_plugin.engines.crf as crf
    import mars_plugin.commands.crf_job as job

    real = crf.dense_crf
    crf.dense_crf = _identity if identity else real
    try:
        t0 = time.perf_counter()
        s = job.crf_job(os.path.join(root, "images"), out, probs_dir=os.path.join(root, "probs"), device=device,
                        batch_size=batch_size, workers=workers, io_workers=None if workers else io_workers,
                        progress=False)
        dt = time.perf_counter() - t0
    finally:
        crf.dense_crf = real
    assert not s.failed, s.failed
    return dt


def coco_line(rate: float) -> str:
    """The COCO-val-sized job at ``rate`` images/s, beside what users report."""
    hours = COCO_VAL / rate / 3600
    return (f"COCO val ({COCO_VAL:,} images) at {rate:.2f} images/s: {hours:.2f} h "
            f"(users report {REPORTED_HOURS} h with {REPORTED_WORKERS} workers: {REPORTED_HOURS / hours:.1f}x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=6)
    ap.add_argument("--io-images", type=int, default=24, help="images of the I/O rows")
    ap.add_argument("--labels", type=int, default=21)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--size", default="375x500", help="HxW")
    args = ap.parse_args()
    H, W = map(int, args.size.split("x"))
    print(machine_line(args.device))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as root:
        n_io = max(args.images, args.io_images)
        make_folder(root, n_io, args.labels, H, W)
        crf_root = os.path.join(root, "crf")
        os.makedirs(crf_root)
        for sub in ("probs", "images"):  # the CRF rows: the first --images files
            os.makedirs(os.path.join(crf_root, sub))
            for f in sorted(os.listdir(os.path.join(root, sub)))[:args.images]:
                os.link(os.path.join(root, sub, f), os.path.join(crf_root, sub, f))
        print(f"mars crf --probs, {W}x{H}, {args.labels} labels, preset mars (10 iterations), on {args.device}")
        print("| what | images | workers | batch | s | images/s |")
        print("| --- | --- | --- | --- | --- | --- |")
        time_job(crf_root, os.path.join(root, "warm"), device=args.device, batch_size=args.batch_size)
        dt = time_job(crf_root, os.path.join(root, "out"), device=args.device, batch_size=args.batch_size)
        rate = args.images / dt
        print(f"| the job (CRF included) | {args.images} | 0 | {args.batch_size} | {dt:.2f} | {rate:.2f} |", flush=True)
        for w in (0, 2):
            dt = time_job(root, os.path.join(root, f"io{w}"), workers=w, batch_size=args.batch_size, identity=True)
            print(f"| I/O alone (CRF stubbed) | {n_io} | {w} | {args.batch_size} | {dt:.2f} | "
                  f"{n_io / dt:.2f} |", flush=True)
    print(coco_line(rate))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
