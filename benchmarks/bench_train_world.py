"""The demo world through the second step: `mars train --backbone resnet18` on the debiased labels
(MARS) and with `--loss ce` on the pseudo labels, then `mars predict` + `mars evaluate` on held-out
images; prints both IoU rows, the biased classes (boat, train) first. The README's demo-world
commands at a chosen size. Minutes to hours on a CPU; prints measured numbers, asserts nothing.

    python benchmarks/bench_train_world.py [--size 48 --num-train 160 --num-val 48] [--iterations 120]
        [--optimizer adamw --lr 3e-4 --weight-decay 1e-4] [--batch-size 4] [--predict-flags "--crf none"]
"""
import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin import cli  # noqa: E402
from mars_plugin.debias import debias_labels  # noqa: E402
from mars_plugin.demo import WORLD_NOISE  # noqa: E402
from mars_plugin.files import write_label  # noqa: E402
from mars_plugin.selection import select_centroids  # noqa: E402
from mars_plugin.synthetic import make_world, write_world  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=48)
    ap.add_argument("--num-train", type=int, default=160)
    ap.add_argument("--num-val", type=int, default=48)
    ap.add_argument("--iterations", type=int, default=120)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--weight-decay", default="1e-4")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--seed", default="0")
    ap.add_argument("--predict-flags", default="", help="extra mars predict flags, e.g. '--crf none --scales 1'")
    args = ap.parse_args()
    print(machine_line("cpu"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        w = make_world(args.num_train + args.num_val, size=args.size, seed=0, **WORLD_NOISE)
        w.features = w.features.half().float()
        tr = w.subset(list(range(args.num_train)))
        va = w.subset(list(range(args.num_train, args.num_train + args.num_val)))
        write_world(tr, root / "train")
        write_world(va, root / "val")
        V = select_centroids(zip(tr.features, tr.pseudo), w.num_classes)
        for s, d in zip(tr.stems, debias_labels(tr.features, tr.pseudo, V, tr.image_classes, image=tr.images)):
            write_label(root / "train" / "debiased" / f"{s}.png", d)
        rows = {}
        for loss, labels in (("mars", "debiased"), ("ce", "labels")):
            t0 = time.perf_counter()
            run, pred = root / f"run_{loss}", root / f"pred_{loss}"
            s = args.size
            assert cli.main(["train", "--images", str(root / "train/images"), "--labels", str(root / "train" / labels),
                             "--image-labels", str(root / "train/image_labels.json"), "--num-classes", "6",
                             "--loss", loss, "--out", str(run), "--backbone", "resnet18",
                             "--iterations", str(args.iterations), "--batch-size", str(args.batch_size),
                             "--crop", str(s), "--min-size", str(s - 8), "--max-size", str(s + 16),
                             "--optimizer", args.optimizer, "--lr", args.lr, "--weight-decay", args.weight_decay,
                             "--seed", args.seed, "--workers", "0", "--no-progress", "--threads", args.threads]) == 0
            assert cli.main(["predict", "--model", str(run / "checkpoint.pt"), "--images", str(root / "val/images"),
                             "--out", str(pred), "--no-progress", *shlex.split(args.predict_flags)]) == 0
            assert cli.main(["evaluate", "--pred", str(pred), "--gt", str(root / "val/gt"), "--num-classes", "6",
                             "--json", str(root / f"{loss}.json"), "--no-progress"]) in (0, 1)
            rows[loss] = (json.loads((root / f"{loss}.json").read_text()), time.perf_counter() - t0)
        names = list(w.class_names)
        order = list(w.problematic) + [c for c in range(len(names)) if c not in w.problematic]
        print(f"\nIoU on {args.num_val} held-out images of {args.size}px, {args.iterations} steps of batch "
              f"{args.batch_size}, {args.optimizer} lr {args.lr}; biased classes first")
        print("| run | " + " | ".join(names[c] for c in order) + " | mIoU | s |")
        print("| --- " * (len(order) + 3) + "|")
        for loss, (sc, t) in rows.items():
            print(f"| {loss} | " + " | ".join(f"{100 * sc['iou'][c]:.1f}" for c in order)
                  + f" | {100 * sc['miou']:.1f} | {t:.0f} |")


if __name__ == "__main__":
    main()
