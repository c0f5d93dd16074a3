"""The whole pipeline's time per image: `mars reproduce --train` end to end on a generated DHR tree.

One `mars reproduce --train` process (the command line, as a user runs it) on N synthetic VOC-sized
images (500x375, :func:`bench_reproduce.make_tree`: one object each, its pseudo label spilling
below it), with a random-weight STEGO of the real size (DINO ViT-B/8 + 70-d heads, DHR's two
files, :func:`bench_reproduce.make_weights`) and DHR's multi-scale + flip features; then the
training (the dhr recipe's DeepLabv3+ ResNet-101, batch 16 of 512 crops, random init, a few
steps: the weights are random, so the scores mean nothing; the work per image is the real one),
the prediction of a validation split (the first half of the images, copied) and the MARS masks
of the training split (multi-scale + flip + CRF).

Each stage's time is the interval between the stage lines the command prints (``[features]``,
``[centroids]``, ... ``[train]``, ``[predict validation]``, ``[masks train_aug]``), stamped as they
arrive on the child's unbuffered stdout; "set-up" is the start of the process (imports) to the
first line. Rows: seconds, seconds per image (the training: per step) and the extrapolation to
VOC train_aug (10,582 images; the training: DHR's 66,100 steps of its schedule are not
extrapolated, see bench_train.py for the step time).

    python benchmarks/bench_pipeline.py [--images 32] [--device cuda] [--fp16] [--steps 20] [--smoke]

``--smoke``: 4 images of 64x48, a 2-block ViT-T/8, ResNet-18, 2 steps of 2 crops of 32, on the
CPU: a check that the script runs (numbers meaningless).
"""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _machine import machine_line  # noqa: E402

VOC_TRAIN_AUG = 10582


def build_tree(root, n, H, W, arch):
    """The DHR tree (train_aug of n images, validation = a copy of the first half), the pseudo
    labels in <root>/pseudo and the STEGO files; returns (backbone, heads)."""
    from bench_reproduce import make_tree, make_weights

    make_tree(root, n, H=H, W=W)
    src, val = os.path.join(root, "VOC2012", "train_aug"), os.path.join(root, "VOC2012", "validation")
    keep = sorted(os.listdir(os.path.join(src, "image")))[:max(1, n // 2)]
    for sub, ext in (("image", ".jpg"), ("mask", ".png")):
        os.makedirs(os.path.join(val, sub))
        for name in keep:
            shutil.copy(os.path.join(src, sub, name[:-4] + ext), os.path.join(val, sub))
    return make_weights(root, arch)


def run_stamped(cmd, env):
    """Run ``cmd``, echo its output, and return ([(seconds since start, line)] of its stage lines, total s)."""
    t0 = time.perf_counter()
    stamps = []
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        for line in p.stdout:
            now = time.perf_counter() - t0
            print("   " + line.rstrip(), flush=True)
            if line.startswith("["):
                stamps.append((now, line.split("]")[0][1:]))
        rc = p.wait()
    total = time.perf_counter() - t0
    if rc:
        raise RuntimeError(f"mars reproduce --train exited with {rc}")
    return stamps, total


def stage_rows(stamps, total):
    """[(stage, seconds)]: set-up, then each stage line to the next (the last to the end)."""
    rows = [("set-up (start, imports, model files)", stamps[0][0] if stamps else total)]
    for i, (t, name) in enumerate(stamps):
        end = stamps[i + 1][0] if i + 1 < len(stamps) else total
        rows.append((name, end - t))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp16", action="store_true", help="features under float16 autocast")
    ap.add_argument("--steps", type=int, default=20, help="training steps (the recipe's batch 16 of 512 crops)")
    ap.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: does the script run?")
    args = ap.parse_args()
    if args.images < 2 or args.steps < 1:
        ap.error(f"--images must be >= 2 and --steps >= 1, got {args.images} and {args.steps}")
    n, dev = (4, "cpu") if args.smoke else (args.images, args.device)
    H, W = (48, 64) if args.smoke else (375, 500)
    print(machine_line(dev))
    print(f"load average: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as root:
        backbone, heads = build_tree(root, n, H, W, "t8" if args.smoke else "b8")
        train = (["--train-backbone", "resnet18", "--iterations", "2", "--train-batch-size", "2", "--crop", "32",
                  "--min-size", "40", "--max-size", "56", "--loader-workers", "0"] if args.smoke else
                 ["--iterations", str(args.steps), "--loader-workers", "4"])
        cmd = [sys.executable, "-c", "import sys; from mars_plugin.cli import main; sys.exit(main(sys.argv[1:]))",
               "reproduce", "--root", root, "--pseudo", os.path.join(root, "pseudo"), "--backbone", backbone,
               "--heads", heads, "--out", os.path.join(root, "out"), "--device", dev, "--batch-size",
               "4" if args.smoke else "16", "--no-progress", "--no-references", "--train"] + train
        if args.fp16:
            cmd.append("--fp16")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        stamps, total = run_stamped(cmd, env)
    steps = 2 if args.smoke else args.steps
    print(f"\nmars reproduce --train, {n} images of {W}x{H} (validation: {max(1, n // 2)} of them), device {dev}"
          f"{', features fp16' if args.fp16 else ''}, {steps} training steps; whole run {total:.1f} s, "
          f"{total / n:.3f} s per image\n")
    print("| stage | s | s per image (train: per step) | VOC train_aug (10,582) |")
    print("| --- | --- | --- | --- |")
    for name, sec in stage_rows(stamps, total):
        if name.startswith("set-up"):  # once per run, not per image
            print(f"| {name} | {sec:.2f} | - | - |")
            continue
        if name == "train":
            print(f"| {name} ({steps} steps) | {sec:.2f} | {sec / steps:.3f} per step | (steps, not images) |")
            continue
        per = max(1, n // 2) if "validation" in name else n
        print(f"| {name} | {sec:.2f} | {sec / per:.3f} | {sec / per * VOC_TRAIN_AUG / 60:.1f} min |")


if __name__ == "__main__":
    main()
