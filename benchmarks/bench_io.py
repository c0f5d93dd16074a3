"""The folder jobs' I/O side (issue 32): images/s of `mars debias`, `mars crf` and `mars predict`
with their device compute replaced by stubs that return at once, at --io-workers 0, 1, 2 (the
threads of :mod:`mars_plugin.runs.io_pipeline` reading ahead and writing behind), on
synthetic 500x375 folders; `mars crf --workers 2` (spawned processes, the arrays pickled through
pipes) beside them.

What runs is everything a job does on the CPU around its device: listing, the run record,
reading and decoding (debias: D=70 .npy features, the label PNG, the PNG image; crf: (21, H, W)
float16 .npy maps and a JPEG; predict: a JPEG), the checks, and encoding and atomically writing
each PNG. The stubs: debias's Eq. 4 (a constant map) and its CRF (a threshold); crf's batch on the
device (each map's labels, as a GPU's argmax gives them back); predict's normalisation, network
and CRF (labels from the red channel, so the PNG is not trivially compressible).

Interleaved rounds (each round runs every row once; the table gives each row's median, and the
median within a round of its ratio to --io-workers 0), the load before and after: the machine is
shared, so read the ratios.

    OMP_NUM_THREADS=1 python benchmarks/bench_io.py [--images 32] [--rounds 3] [--smoke]
"""
import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Tuple

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _machine import machine_line  # noqa: E402


def make_folders(root: str, n: int, H: int, W: int, labels: int = 21) -> None:
    """``root/debias/{features,labels,images}`` (bench_debias's) and ``root/crf/{probs,images}``
    (bench_crf_job's: JPEG images, also predict's)."""
    import bench_crf_job
    import bench_debias

    d = os.path.join(root, "debias")
    for sub in ("features", "labels", "images"):
        os.makedirs(os.path.join(d, sub))
    bench_debias.make_folder(d, n, H, W)
    bench_crf_job.make_folder(os.path.join(root, "crf"), n, labels, H, W)


def centroids(root: str) -> str:
    """The debias folder's centroids (bench_debias's recipe), saved once."""
    from mars_plugin import select_centroids
    from mars_plugin.formats.files import read_features, read_label

    d = os.path.join(root, "debias")
    stems = sorted(f[:-4] for f in os.listdir(os.path.join(d, "features")))[:4]
    V = select_centroids([(read_features(os.path.join(d, "features", s + ".npy")),
                           read_label(os.path.join(d, "labels", s + ".png"))) for s in stems], 4)
    path = os.path.join(root, "V.pt")
    V.save(path)
    return path


_PATTERNS = {}


def _pattern(size) -> np.ndarray:
    """(H, W) int64 labels 0..3 in blobs (made once per size): a stub's output whose PNG is not
    trivially compressible."""
    if tuple(size) not in _PATTERNS:
        H, W = size
        yy, xx = np.mgrid[0:H, 0:W]
        _PATTERNS[tuple(size)] = ((np.sin(xx / 23.0) + np.cos(yy / 17.0) + 2) * 1.99).astype(np.int64) % 4
    return _PATTERNS[tuple(size)]


@contextmanager
def stubbed(job: str, device_ms: float = 0.0):
    """The job's device compute replaced by functions that return at once, or after
    ``device_ms`` per batch in ``time.sleep`` (which, like waiting on a GPU, leaves the GIL to
    the workers)."""
    saved = []

    def wait():
        if device_ms:
            time.sleep(device_ms / 1000)

    def put(module, name, value):
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    if job == "debias":
        import mars_plugin.commands.debias as m

        put(m, "debiased_similarity", lambda feats, V, classes, size: torch.full(size, 0.4))
        put(m, "refine_mask", lambda sims, images, *a, **k: wait() or [s > 0.5 for s in sims])
    elif job == "crf":
        import mars_plugin.commands.crf_job as m

        # what a GPU gives back for --probs to labels: each map's (H, W) argmax (taken there)
        put(m, "_crf_batch", lambda items, *a, **k: wait() or [[_pattern(it["size"])] for it in items])
    else:
        import mars_plugin.commands.predict as m

        put(m, "multiscale_probs", lambda model, x, *a, **k: x)
        put(m, "labels_from_probs", lambda probs, rgb, *a, **k: wait() or (rgb[..., 0] // 52).long())
    try:
        yield
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


#: torch's CPU threads of every run (``--threads``).
THREADS = 1


def run(job: str, root: str, out: str, V: str, io_workers: int, workers: int, batch_size: int,
        device_ms: float = 0.0) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one run of ``job`` into a new folder ``out``."""
    from mars_plugin.commands.crf_job import crf_job
    from mars_plugin.commands.debias import debias_job
    from mars_plugin.commands.predict import predict_job

    d, c = os.path.join(root, "debias"), os.path.join(root, "crf")
    torch.set_num_threads(THREADS)  # again before each run: building the folders (numba's import) may change it
    with stubbed(job, device_ms):
        t0, c0 = time.perf_counter(), time.process_time()
        if job == "debias":
            s = debias_job(os.path.join(d, "features"), os.path.join(d, "labels"), V, out,
                           images_dir=os.path.join(d, "images"), batch_size=batch_size, io_workers=io_workers,
                           progress=False)
        elif job == "crf":
            s = crf_job(os.path.join(c, "images"), out, probs_dir=os.path.join(c, "probs"), batch_size=batch_size,
                        workers=workers, io_workers=None if workers else io_workers, progress=False)
        else:
            s = predict_job(torch.nn.Identity(), os.path.join(c, "images"), out, batch_size=batch_size,
                            preprocess=lambda rgb: rgb, io_workers=io_workers, progress=False, max_bytes=None)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert not s.failed and s.done > 0, (job, s.failed)
    return dt, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--size", default="375x500", help="HxW")
    ap.add_argument("--jobs", default="debias,crf,predict")
    ap.add_argument("--io-workers", default="0,1,2")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="the stubbed device compute's time per batch (a sleep, as a GPU's: 0 returns at once)")
    ap.add_argument("--workers-row", action=argparse.BooleanOptionalAction, default=True,
                    help="also mars crf --workers 2 (processes)")
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (each job's main thread and workers)")
    ap.add_argument("--smoke", action="store_true", help="4 images of 64x48, one round: that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.images, args.rounds, args.size = 4, 1, "48x64"
    H, W = map(int, args.size.split("x"))
    global THREADS
    THREADS = args.threads
    jobs = args.jobs.split(",")
    levels = [int(x) for x in args.io_workers.split(",")]
    rows = [(j, w, 0) for j in jobs for w in levels] + ([("crf", 0, 2)] if "crf" in jobs and args.workers_row else [])
    print(machine_line("cpu"))
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    times = {r: [] for r in rows}
    cpus = {r: [] for r in rows}
    with tempfile.TemporaryDirectory() as root:
        make_folders(root, args.images, H, W)
        V = centroids(root)
        for job in jobs:  # warm: imports, first-touch of the files
            run(job, root, os.path.join(root, f"warm-{job}"), V, 0, 0, args.batch_size)
        for k in range(args.rounds):
            for r in rows:
                out = os.path.join(root, "out")
                dt, cpu = run(r[0], root, out, V, r[1], r[2], args.batch_size, args.device_ms)
                times[r].append(dt)
                cpus[r].append(cpu)
                shutil.rmtree(out)
    print(f"{args.images} images {W}x{H}, --batch-size {args.batch_size}, device compute stubbed, "
          f"{args.rounds} interleaved rounds, torch threads {THREADS}, device stub {args.device_ms:g} ms per batch")
    print("| job | --io-workers | --workers | images/s (median) | x io-workers 0 (median of rounds) "
          "| CPU ms per image | cores used |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        base = times[(r[0], 0, 0)]
        ratio = statistics.median(b / t for b, t in zip(base, times[r]))
        rate = args.images / statistics.median(times[r])
        cpu = statistics.median(cpus[r])  # this process only (not --workers processes)
        used = statistics.median(c / t for c, t in zip(cpus[r], times[r]))
        print(f"| {r[0]} | {r[1] if not r[2] else '-'} | {r[2] or '-'} | {rate:.1f} | {ratio:.2f} "
              f"| {1000 * cpu / args.images:.0f} | {used:.2f} |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
