"""Images per second of `mars debias` (the folder job, reading and writing files included) on
generated VOC-sized 500x375 images with D=70 features at stride 8, extrapolated to VOC
train_aug (10,582 images):

* refine=threshold, and refine=crf with the torch CRF (workers x threads, --batch-size) and the
  pydensecrf reference (--crf-backend pydensecrf, one image at a time per worker);
* with --device cuda (when a GPU is there) the torch CRF at batch 16 and 64.

    python benchmarks/bench_debias.py [--images 32] [--workers 1,2] [--preset mars]

``--cli`` measures the command instead, as a user runs it (``python -m mars_plugin.cli debias``
in a fresh process, torch's import inside the clock): with its defaults, and with
``--crf-backend pydensecrf``, in --rounds interleaved rounds at each --busy level (N CPU-bound
processes ``while 1: pass`` running meanwhile), and ours over pydensecrf within each round;
``--baseline DIR`` adds the same command run from another checkout (e.g. the previous version):

    python benchmarks/bench_debias.py --cli --busy 0,1 [--rounds 5] [--images 8] [--baseline DIR]
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin import select_centroids  # noqa: E402
from mars_plugin.formats.files import write_features, write_image, write_label  # noqa: E402
from mars_plugin.commands.debias import debias_job  # noqa: E402


def make_folder(root: str, n: int, H: int = 375, W: int = 500, D: int = 70, stride: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    protos = rng.normal(size=(8, D)).astype(np.float32)
    colours = rng.integers(0, 256, size=(8, 3))
    for i in range(n):
        kinds = np.zeros((H, W), np.int64)
        kinds[H // 2 :] = 1 + i % 3
        y0, x0 = rng.integers(0, H // 2), rng.integers(0, W // 2)
        kinds[y0 : y0 + H // 3, x0 : x0 + W // 3] = 4 + i % 4
        label = np.where(kinds >= 4, kinds - 3, 0)
        label[y0 + H // 3 : y0 + H // 3 + 20, x0 : x0 + W // 3] = label[y0, x0]  # a biased band
        small = kinds[stride // 2 :: stride, stride // 2 :: stride]  # the feature grid, ceil(H / stride)
        feats = protos[small].transpose(2, 0, 1) + 0.05 * rng.normal(size=(D,) + small.shape).astype(np.float32)
        img = np.clip(colours[kinds] + rng.normal(0, 10, size=(H, W, 3)), 0, 255).astype(np.uint8)
        stem = f"img{i:05d}"
        write_features(os.path.join(root, "features", stem + ".npy"), feats)
        write_label(os.path.join(root, "labels", stem + ".png"), torch.from_numpy(label))
        write_image(os.path.join(root, "images", stem + ".png"), img)


VOC_TRAIN_AUG = 10582
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _command_env(checkout: str) -> dict:
    """A command's environment: ``checkout`` first on PYTHONPATH, no OpenMP wait setting of ours."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = os.pathsep.join([checkout, os.environ.get("PYTHONPATH", "")])
    return env


def cli_table(args) -> None:
    """`mars debias` (defaults) against `--crf-backend pydensecrf`, each a fresh process, in
    interleaved rounds per --busy level."""
    import numpy as np

    variants = [("ours (defaults)", ROOT, []), ("pydensecrf", ROOT, ["--crf-backend", "pydensecrf"])]
    if args.baseline:
        variants.insert(1, ("baseline (defaults)", os.path.abspath(args.baseline), []))
    levels = [int(x) for x in args.busy.split(",")]
    with tempfile.TemporaryDirectory() as root:
        make_folder(root, args.images)
        common = ["--features", os.path.join(root, "features"), "--labels", os.path.join(root, "labels")]
        subprocess.run([sys.executable, "-m", "mars_plugin.cli", "centroids", *common, "--num-classes", "4",
                        "--out", os.path.join(root, "V.pt"), "--no-progress"], env=_command_env(ROOT), check=True,
                       capture_output=True)
        out = os.path.join(root, "out")

        def run(checkout, extra):
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "mars_plugin.cli", "debias", *common, "--centroids",
                                os.path.join(root, "V.pt"), "--images", os.path.join(root, "images"), "--out", out,
                                "--crf-params", args.preset, "--no-progress", *extra], env=_command_env(checkout),
                               capture_output=True, text=True, cwd=root)  # not here: -m would import this checkout
            if r.returncode:
                raise SystemExit(f"mars debias failed:\n{r.stderr[-3000:]}")
            return time.perf_counter() - t0

        for _, checkout, extra in variants:  # warm-up (numba's cache, the file system)
            run(checkout, extra)
        times, loads = {}, {}
        for _ in range(args.rounds):
            for level in levels:
                busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(level)]
                try:
                    time.sleep(1.0)
                    for name, checkout, extra in variants:
                        times.setdefault((level, name), []).append(run(checkout, extra))
                        loads.setdefault(level, []).append(os.getloadavg()[0])
                finally:
                    for p in busy:
                        p.kill()
                        p.wait()
    print(machine_line("cpu"))
    print(f"`mars debias` of {args.images} images 500x375 (D=70 features at stride 8, CRF preset {args.preset}), "
          f"each a fresh process; {args.rounds} interleaved rounds; s: median [min-max]; ratio: this over "
          "pydensecrf in the same round, median [range]; load: 1-minute load average while measuring")
    print("| busy processes | load | command | s | ratio to pydensecrf |")
    print("| --- | --- | --- | --- | --- |")
    for level in levels:
        ref = np.array(times[(level, "pydensecrf")])
        for name, _, _ in variants:
            t = np.array(times[(level, name)])
            r = t / ref
            print(f"| {level} | {min(loads[level]):.1f}-{max(loads[level]):.1f} | {name} | {np.median(t):.2f} "
                  f"[{t.min():.2f}-{t.max():.2f}] | {np.median(r):.2f} [{r.min():.2f}-{r.max():.2f}] |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--preset", default="mars", help="CRF preset (mars or psa)")
    ap.add_argument("--no-reference", dest="reference", action="store_false", help="skip the pydensecrf rows")
    ap.add_argument("--cli", action="store_true", help="time the `mars debias` command against pydensecrf")
    ap.add_argument("--busy", default="0,1", help="--cli: levels of busy processes")
    ap.add_argument("--rounds", type=int, default=5, help="--cli: interleaved rounds")
    ap.add_argument("--baseline", default=None, help="--cli: another checkout whose `mars debias` to time too")
    args = ap.parse_args()
    if args.cli:
        cli_table(args)
        return
    try:
        import pydensecrf  # noqa: F401
    except ImportError:
        args.reference = False
    runs = [("threshold", "torch", "cpu", 8, w) for w in (1,)]
    for w in (int(x) for x in args.workers.split(",")):
        runs.append(("crf", "torch", "cpu", 8, w))
        if args.reference:
            runs.append(("crf", "pydensecrf", "cpu", 8, w))
    if torch.cuda.is_available():
        runs += [("crf", "torch", "cuda", b, 1) for b in (16, 64)]
    with tempfile.TemporaryDirectory() as root:
        make_folder(root, args.images)
        from mars_plugin.formats.files import read_features, read_label

        stems = sorted(f[:-4] for f in os.listdir(os.path.join(root, "features")))
        V = select_centroids(((read_features(os.path.join(root, "features", s + ".npy")),
                               read_label(os.path.join(root, "labels", s + ".png"))) for s in stems), 4)
        V.save(os.path.join(root, "V.pt"))
        print(machine_line("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"{args.images} images 500x375, features D=70 at stride 8, CRF preset {args.preset}")
        print("| refine | CRF backend | device | batch | workers | s | images/s | VOC train_aug (10,582) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        reference_out = None
        for refine, backend, device, batch, w in runs:
            out = os.path.join(root, f"out_{refine}_{backend}_{device}_{batch}_{w}")
            t0 = time.perf_counter()
            s = debias_job(os.path.join(root, "features"), os.path.join(root, "labels"), os.path.join(root, "V.pt"),
                           out, images_dir=os.path.join(root, "images"), refine=refine, workers=w, batch_size=batch,
                           device=device, crf_params=args.preset, crf_backend=backend, progress=False)
            dt = time.perf_counter() - t0
            assert s.done == args.images
            if refine == "crf" and backend == "pydensecrf":
                reference_out = out
            voc = VOC_TRAIN_AUG * dt / args.images
            print(f"| {refine} | {backend if refine == 'crf' else '-'} | {device} | {batch} | {w} | {dt:.2f} | "
                  f"{args.images / dt:.2f} | {voc / 60:.1f} min |", flush=True)
        if reference_out is not None:
            from mars_plugin.formats.files import read_label as rl

            torch_out = os.path.join(root, "out_crf_torch_cpu_8_1")
            same = np.mean([float((rl(os.path.join(torch_out, s + ".png")) == rl(os.path.join(reference_out, s + ".png")))
                                  .float().mean()) for s in stems])
            print(f"torch CRF labels equal to the pydensecrf backend's on {100 * same:.4f}% of the pixels")


if __name__ == "__main__":
    main()
