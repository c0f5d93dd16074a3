"""Every GPU row of the project in one process (run by benchmarks/gpu.sh): the dense CRF at batch
1/16/64, the pydensecrf drop-in on CUDA at 21 and 81 labels, the blur's gather forms at 2-81 labels,
the lattice filter torch vs the Triton kernels (and the dense CRF both ways),
`mars crf` at 21 and 81 labels (and COCO val extrapolated), `mars debias --device cuda` (both at
--io-workers 0 and 4), the folder jobs' I/O side alone (`bench_io.py`), the training
step (CE vs MARS with the CRF teacher), and the
CUDA rows of the benchmarks that already have them (features fp32/fp16, batched fp16, `mars predict`),
and the whole pipeline (`reproduce`: `mars reproduce --train` of 32 synthetic images, s per image
per stage).

Each section prints a markdown table and its wall time; a failing section prints its error and
the others still run. ``--smoke`` runs every section at toy sizes on the CPU (a check that the
script works, numbers meaningless), which the test suite does not do: it is for developers.

    python benchmarks/bench_gpu.py [--sections cuda_tests,triton,train,profile,debias,crf_job,predict,features,reproduce,io,crf,densecrf,gather] [--smoke]
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _machine import machine_line  # noqa: E402


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def section_crf(dev, smoke):
    """Images/s of the dense CRF at 500x375 (VOC), 10 iterations, both presets, 2 and 21 labels."""
    from bench_crf import natural_image, smooth_probs, time_ours

    from mars_plugin.engines.crf_params import CRF_PRESETS

    H, W = (375, 500) if not smoke else (60, 80)
    batches = (1, 16, 64) if not smoke else (1, 4)
    print(f"dense CRF, {W}x{H}, 10 iterations, on {dev}; images/s of the best of 2 passes over max(batch, 16) "
          "images after a warm-up call")
    print("| preset | labels | batch | images/s | VOC train_aug (10,582) |")
    print("| --- | --- | --- | --- | --- |")
    imgs = [natural_image(H, W, s) for s in range(8)]
    for preset in ("mars", "psa"):
        for L in (2, 21):
            probs = [smooth_probs(L, H, W, s) for s in range(8)]
            for b in batches:
                n = max(b, 16 if not smoke else 4)
                P, Im = (probs * (n // 8 + 1))[:n], (imgs * (n // 8 + 1))[:n]
                time_ours(P[:b], Im[:b], CRF_PRESETS[preset], b, dev)  # warm-up (kernels, allocator)
                t = min(time_ours(P, Im, CRF_PRESETS[preset], b, dev)[0] for _ in range(2))
                print(f"| {preset} | {L} | {b} | {n / t:.1f} | {10582 * t / n / 60:.1f} min |", flush=True)


def section_debias(dev, smoke):
    """`mars debias` (the folder job: read, CRF on the device, write) images/s."""
    from bench_debias import make_folder

    from mars_plugin.formats.files import read_features, read_label
    from mars_plugin.commands.debias import debias_job
    from mars_plugin.method.selection import select_centroids

    n = 64 if not smoke else 4
    with tempfile.TemporaryDirectory() as root:
        make_folder(root, n)
        stems = sorted(f[:-4] for f in os.listdir(os.path.join(root, "features")))
        V = select_centroids(((read_features(os.path.join(root, "features", s + ".npy")),
                               read_label(os.path.join(root, "labels", s + ".png"))) for s in stems), 4)
        V.save(os.path.join(root, "V.pt"))
        print(f"mars debias --device {dev} on {n} images 500x375 (features D=70 at stride 8, CRF preset mars)")
        print("| batch | --io-workers | s | images/s | VOC train_aug (10,582) |")
        print("| --- | --- | --- | --- | --- |")
        for b in ((16, 64) if not smoke else (4,)):
            for io in (0, 4):  # the files read and written in this thread, or in 4 beside the GPU
                for rep in range(2):  # the first pass warms up the CUDA kernels
                    out = os.path.join(root, f"out_{b}_{io}_{rep}")
                    t0 = time.perf_counter()
                    s = debias_job(os.path.join(root, "features"), os.path.join(root, "labels"),
                                   os.path.join(root, "V.pt"), out, images_dir=os.path.join(root, "images"),
                                   refine="crf", batch_size=b, device=dev, io_workers=io, progress=False)
                    dt = time.perf_counter() - t0
                assert s.done == n, s.line()
                print(f"| {b} | {io} | {dt:.2f} | {n / dt:.1f} | {10582 * dt / n / 60:.1f} min |", flush=True)


def _script(args):
    cmd = [sys.executable, os.path.join(HERE, args[0])] + list(args[1:])
    print("$ " + " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT)
    if r.returncode:
        raise RuntimeError(f"{args[0]} exited with {r.returncode}")


def section_train(dev, smoke):
    """`mars train` s/step: CE vs MARS with the CRF teacher at batch 16 x 512 x 512 (AMP)."""
    if smoke:
        _script(["bench_train.py", "--backbone", "resnet18", "--batch", "2", "--crop", "64", "--steps", "3",
                 "--warmup", "1", "--images", "4", "--workers", "0", "--device", dev])
    else:
        _script(["bench_train.py", "--device", dev, "--steps", "10", "--warmup", "4"])


def section_profile(dev, smoke):
    """Where one MARS step's time goes (student, teacher, complement, the CRF's lattice builds and
    one filter, torch.profiler's top kernels): the profile behind the train section's ratio."""
    if smoke:
        _script(["profile_mars_step.py", "--batch", "2", "--size", "64", "--backbone", "resnet18", "--device", dev])
    else:
        _script(["profile_mars_step.py", "--device", dev])


def section_features(dev, smoke):
    """`mars features` (DHR's multi-scale inference, STEGO ViT-B/8) fp32 and fp16, one image; fp16
    also batched (1 and 8 images of 500x375 in one call per scale), with the TFLOP/s reached."""
    if smoke:
        _script(["bench_multiscale.py", "--device", dev, "--arch", "s8", "--repeats", "1", "--size", "64x48",
                 "--batches", "1,2"])
        return
    _script(["bench_multiscale.py", "--device", dev])
    _script(["bench_multiscale.py", "--device", dev, "--fp16", "--batches", "1,8"])


def section_reproduce(dev, smoke):
    """The whole pipeline: `mars reproduce --train` of 32 synthetic 500x375 images end to end
    (features fp16, centroids, debias, evaluate, report, 20 training steps, predict, masks), the
    seconds per image of each stage (bench_pipeline.py)."""
    if smoke:
        _script(["bench_pipeline.py", "--smoke"])
    else:
        _script(["bench_pipeline.py", "--device", dev, "--images", "32", "--steps", "20", "--fp16"])


def section_predict(dev, smoke):
    """`mars predict` images/s with multi-scale + flip + CRF (fp32, bf16, bf16 with NHWC), the
    network's TFLOP/s beside."""
    if not os.path.isfile(os.path.join(HERE, "bench_predict.py")):
        print("bench_predict.py is not there: no predict row")
        return
    if smoke:
        _script(["bench_predict.py", "--device", dev, "--smoke"])
    else:
        _script(["bench_predict.py", "--device", dev, "--size", "375x500"])
        _script(["bench_predict.py", "--device", dev, "--size", "375x500", "--fp16"])
        # the same with the network in NHWC (cuDNN's tensor-core layout): whether predict should switch
        _script(["bench_predict.py", "--device", dev, "--size", "375x500", "--fp16", "--channels-last"])


def section_crf_job(dev, smoke):
    """`mars crf --probs` (the folder job: read, CRF on the device, write) images/s at 21 and 81
    labels, 500x375, and the COCO-val-sized job extrapolated from the measured rate."""
    from bench_crf_job import coco_line, make_folder, time_job

    H, W = (375, 500) if not smoke else (60, 80)
    print(f"mars crf --probs --device {dev}, {W}x{H}, preset mars (10 iterations); every image holds all L labels "
          "(a codebase's CAMs hold a few classes each: faster)")
    print("| labels | images | batch | --io-workers | s | images/s | COCO val (40,137) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    lines = []
    for L, n, b in ((21, 64, 32), (81, 32, 16)) if not smoke else ((21, 4, 2), (81, 2, 2)):
        with tempfile.TemporaryDirectory() as root:
            make_folder(root, n, L, H, W)
            time_job(root, os.path.join(root, "warm"), device=dev, batch_size=b)  # CUDA kernels, allocator
            for io in (0, 4):  # the files read and written in this thread, or in 4 beside the GPU
                dt = time_job(root, os.path.join(root, f"out{io}"), device=dev, batch_size=b, io_workers=io)
                print(f"| {L} | {n} | {b} | {io} | {dt:.1f} | {n / dt:.1f} | {40137 * dt / n / 3600:.2f} h |",
                      flush=True)
                lines.append(f"{L} labels, --io-workers {io}: " + coco_line(n / dt))
    print("\n".join(lines))



def section_io(dev, smoke):
    """The folder jobs' I/O side (debias, crf, predict with the device compute stubbed) at
    --io-workers 0, 2, 4 on this machine's CPU cores (benchmarks/bench_io.py)."""
    if smoke:
        _script(["bench_io.py", "--smoke"])
    else:
        _script(["bench_io.py", "--images", "64", "--rounds", "3", "--io-workers", "0,2,4"])


def section_densecrf(dev, smoke):
    """The pydensecrf drop-in on CUDA, one image per object as an unchanged codebase calls it:
    deeplab-pytorch's and IRNet's settings at 21 and 81 labels, 500x375."""
    if smoke:
        _script(["bench_densecrf.py", "--labels", "2", "--settings", "deeplab-pytorch", "--rounds", "1",
                 "--height", "48", "--width", "64", "--no-reference"])
    else:
        _script(["bench_densecrf.py", "--device", dev, "--labels", "", "--cuda-labels", "21,81", "--rounds", "3"])


def section_gather(dev, smoke):
    """The lattice blur's gather forms (rows vs the transposed values) at 2-81 labels."""
    if smoke:
        _script(["bench_gather.py", "--device", dev, "--channels", "2", "--repeats", "1"])
    else:
        _script(["bench_gather.py", "--device", dev, "--repeats", "15"])


def section_triton(dev, smoke):
    """The lattice filter torch vs Triton (16 x 512x512, 4 and 21 labels) and the dense CRF both ways."""
    if smoke:  # the CPU under Triton's interpreter: equality only (bench_triton.py sets it up)
        _script(["bench_triton.py", "--smoke"])
    else:
        _script(["bench_triton.py", "--device", dev])


def section_cuda_tests(dev, smoke):
    """The test suite's CUDA tests (each compares a CUDA path with the CPU's: the pipeline, the
    dense CRF, the drop-in, `mars crf`, the Triton kernels compiled): they are skipped in CI."""
    files = ["test_cuda.py", "test_crf.py", "test_crf_job.py", "test_densecrf_dropin.py", "test_kmeans.py",
             "test_permutohedral_triton.py", "test_predict.py", "test_cli.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda"]
    cmd += [os.path.join(HERE, "..", "tests", f) for f in (files[:1] if smoke else files)]
    print("$ " + " ".join(cmd[1:]), flush=True)
    r = subprocess.run(cmd, stdout=sys.stdout, stderr=subprocess.STDOUT, cwd=os.path.join(HERE, ".."))
    if r.returncode not in (0, 5):  # 5: nothing collected (no CUDA test selected)
        raise RuntimeError(f"the CUDA tests exited with {r.returncode}")


# In the order a lent card should measure them: the tests and the rows no card has measured yet
# first (issue 32's), the rows measured on an H100 on 2026-11-27 last; gpu.sh's output is kept
# as it goes, so a call cut short by its time limit still returns the first sections.
SECTIONS = {"cuda_tests": section_cuda_tests, "triton": section_triton, "train": section_train,
            "profile": section_profile, "debias": section_debias, "crf_job": section_crf_job,
            "predict": section_predict, "features": section_features, "reproduce": section_reproduce,
            "io": section_io, "crf": section_crf, "densecrf": section_densecrf, "gather": section_gather}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: does the script run?")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("bench_gpu.py: no GPU here (torch.cuda.is_available() is False): nothing to measure")
        return 0
    print(machine_line(dev))
    failed = []
    for name in args.sections.split(","):
        print(f"\n## {name}", flush=True)
        t0 = time.perf_counter()
        try:
            SECTIONS[name](dev, args.smoke)
        except Exception:  # noqa: BLE001 -- one section's failure must not lose the others' rows
            traceback.print_exc(file=sys.stdout)
            failed.append(name)
        print(f"({name}: {time.perf_counter() - t0:.0f} s)", flush=True)
    if failed:
        print(f"failed sections: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
