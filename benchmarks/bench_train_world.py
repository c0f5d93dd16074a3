"""The demo world through the second step: `mars train --backbone resnet18` on the debiased labels
(MARS) and with `--loss ce` on the pseudo labels, then `mars predict` + `mars evaluate` on held-out
images (and the argmax of one forward pass of the student); prints the IoU rows of every seed, the
biased classes (boat, train) first, and the MARS - CE difference on them. The README's demo-world
commands at a chosen size. Minutes on a CPU per run; prints measured numbers, asserts nothing.

    python benchmarks/bench_train_world.py [--size 64 --num-train 200 --num-val 60] [--iterations 300]
        [--batch-size 8 --output-stride 8 --optimizer adamw --lr 3e-4 --weight-decay 1e-4 --ema 0.99]
        [--seeds 0,1,2] [--device cpu|cuda] [--data DIR] [--json FILE] [--predict-flags "--crf none" ...]

``--data DIR`` keeps the generated world and its debiased labels there (made once, then reused:
several processes with different seeds can share one).
"""
import argparse
import contextlib
import io
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _machine import machine_line  # noqa: E402

from mars_plugin import cli  # noqa: E402
from mars_plugin.method.debias import debias_labels  # noqa: E402
from mars_plugin.commands.demo import WORLD_NOISE  # noqa: E402
from mars_plugin.formats.files import IGNORE_VALUE, atomic_write, read_label, write_label  # noqa: E402
from mars_plugin.commands.metrics import confusion_matrix, segmentation_scores  # noqa: E402
from mars_plugin.networks.seg_checkpoint import model_from_checkpoint  # noqa: E402
from mars_plugin.networks.seg_data import normalize  # noqa: E402
from mars_plugin.method.selection import select_centroids  # noqa: E402
from mars_plugin.worlds.synthetic import write_world  # noqa: E402
from mars_plugin.worlds.synthetic_scenes import make_world  # noqa: E402

LABELS = {"mars": "debiased", "ce": "labels"}


def prepare(root: Path, size: int, num_train: int, num_val: int):
    """The world (written once into ``root``), its debiased labels, and the world object."""
    w = make_world(num_train + num_val, size=size, seed=0, **WORLD_NOISE)
    # The features as `mars demo` writes them (float16), so that the folder commands agree.
    w.features = w.features.half().float()
    tr = w.subset(list(range(num_train)))
    va = w.subset(list(range(num_train, num_train + num_val)))
    done = root / "ready.json"
    want = {"size": size, "num_train": num_train, "num_val": num_val}
    if done.is_file() and json.loads(done.read_text()) == want:
        return w, tr, va
    write_world(tr, root / "train", overwrite=True)
    write_world(va, root / "val", overwrite=True)
    V = select_centroids(zip(tr.features, tr.pseudo), w.num_classes)
    for s, d in zip(tr.stems, debias_labels(tr.features, tr.pseudo, V, tr.image_classes, image=tr.images)):
        write_label(root / "train" / "debiased" / f"{s}.png", d)
    atomic_write(done, lambda tmp: Path(tmp).write_text(json.dumps(want)))
    return w, tr, va


def label_quality(root: Path, tr, num_classes: int):
    """IoU of the training labels themselves against the ground truth (254 counted as ignored)."""
    rows = {}
    for name in ("labels", "debiased"):
        y = torch.stack([torch.as_tensor(read_label(root / "train" / name / f"{s}.png")).long() for s in tr.stems])
        y = torch.where(y >= 254, torch.full_like(y, IGNORE_VALUE), y)
        rows[name] = segmentation_scores(confusion_matrix(y, tr.gt, num_classes))
    return rows


def argmax_scores(ckpt: Path, va, num_classes: int, device: str, which: str = "student"):
    model, _ = model_from_checkpoint(ckpt, which=which)
    model = model.to(device).eval()
    with torch.no_grad():
        pred = torch.cat([model(normalize(va.images[i:i + 16]).to(device)).argmax(1).cpu()
                          for i in range(0, va.num_images, 16)])
    return segmentation_scores(confusion_matrix(pred, va.gt, num_classes))


def dump(args, q, names, order, rows) -> None:
    atomic_write(args.json, lambda tmp: Path(tmp).write_text(json.dumps({"args": vars(args), "labels": {
        k: {names[c]: round(100 * v["iou"][c], 1) for c in order} for k, v in q.items()}, "rows": rows}, indent=1)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--num-train", type=int, default=200)
    ap.add_argument("--num-val", type=int, default=60)
    ap.add_argument("--iterations", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--output-stride", default="8")
    ap.add_argument("--optimizer", default="adamw")
    ap.add_argument("--lr", default="3e-4")
    ap.add_argument("--weight-decay", default="1e-4")
    ap.add_argument("--ema", default="0.99")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--losses", default="mars,ce")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", default=None, help="folder for the world (default: a temporary one)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file (after every run)")
    ap.add_argument("--tag", default="", help="suffix of the run folders (several settings sharing one --data)")
    ap.add_argument("--prepare-only", action="store_true", help="write the world into --data and stop")
    ap.add_argument("--no-predict", action="store_true", help="score the argmax of one forward pass only")
    ap.add_argument("--predict-flags", action="append", default=None,
                    help="mars predict flags of one evaluation row, e.g. '--crf none'; repeat for more rows "
                         "(default: two rows, mars predict's defaults and '--crf none')")
    args = ap.parse_args()
    torch.set_num_threads(int(args.threads))
    print(machine_line(args.device.split(":")[0]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data or tmp)
        root.mkdir(parents=True, exist_ok=True)
        w, tr, va = prepare(root, args.size, args.num_train, args.num_val)
        if args.prepare_only:
            return
        names = list(w.class_names)
        order = list(w.problematic) + [c for c in range(len(names)) if c not in w.problematic]
        q = label_quality(root, tr, w.num_classes)
        print(f"training labels against the ground truth ({args.num_train} images of {args.size}px): "
              + "; ".join(f"{k}: " + " ".join(f"{names[c]} {100 * v['iou'][c]:.1f}" for c in order)
                          for k, v in q.items()), flush=True)
        rows = []
        s = args.size
        for seed in args.seeds.split(","):
            for loss in args.losses.split(","):
                t0 = time.perf_counter()
                run, pred = root / f"run_{loss}_s{seed}{args.tag}", root / f"pred_{loss}_s{seed}{args.tag}"
                assert cli.main(["train", "--images", str(root / "train/images"),
                                 "--labels", str(root / "train" / LABELS[loss]),
                                 "--image-labels", str(root / "train/image_labels.json"), "--num-classes", "6",
                                 "--loss", loss, "--out", str(run), "--arch", "deeplabv3+", "--backbone", "resnet18",
                                 "--output-stride", args.output_stride, "--iterations", str(args.iterations),
                                 "--batch-size", str(args.batch_size), "--crop", str(s), "--min-size", str(s - 8),
                                 "--max-size", str(s + 16), "--optimizer", args.optimizer, "--lr", args.lr,
                                 "--weight-decay", args.weight_decay, "--seed", seed,
                                 *(["--ema", args.ema] if loss == "mars" else []),  # CE has no teacher
                                 "--workers", "0", "--no-progress", "--threads", args.threads,
                                 "--device", args.device, "--save-every", str(args.iterations)]) == 0
                t_train = time.perf_counter() - t0
                ck = run / "checkpoint.pt"
                found = {"argmax": argmax_scores(ck, va, w.num_classes, args.device)}
                if loss == "mars":
                    found["argmax teacher"] = argmax_scores(ck, va, w.num_classes, args.device, "teacher")
                for k, flags in enumerate([] if args.no_predict else (args.predict_flags or ["", "--crf none"])):
                    p = pred.with_name(f"{pred.name}_{k}")
                    assert cli.main(["predict", "--model", str(ck), "--images", str(root / "val/images"),
                                     "--out", str(p), "--no-progress", "--device", args.device,
                                     *shlex.split(flags)]) == 0
                    js = root / f"{loss}_s{seed}{args.tag}_{k}.json"
                    with contextlib.redirect_stdout(io.StringIO()):  # its table: the rows below say it
                        assert cli.main(["evaluate", "--pred", str(p), "--gt", str(root / "val/gt"),
                                         "--num-classes", "6", "--json", str(js), "--no-progress"]) in (0, 1)
                    found[f"mars predict {flags}".strip()] = json.loads(js.read_text())
                for ev, sc in found.items():
                    rows.append({"seed": int(seed), "loss": loss, "eval": ev, "train_s": round(t_train, 1),
                                 "iou": {names[c]: round(100 * sc["iou"][c], 1) for c in order},
                                 "miou": round(100 * sc["miou"], 1)})
                    r = rows[-1]
                    print(f"| {seed} | {loss} | {ev} | " + " | ".join(f"{v:.1f}" for v in r["iou"].values())
                          + f" | {r['miou']:.1f} | {t_train:.0f} |", flush=True)
                if args.json:
                    dump(args, q, names, order, rows)
        print(f"\nIoU on {args.num_val} held-out images of {s}px; {args.iterations} steps of batch {args.batch_size}, "
              f"{args.optimizer} lr {args.lr}, EMA {args.ema}, output stride {args.output_stride}, {args.device}; "
              "biased classes first")
        print("| seed | run | eval | " + " | ".join(names[c] for c in order) + " | mIoU | train s |")
        print("| --- " * (len(order) + 5) + "|")
        for r in rows:
            print(f"| {r['seed']} | {r['loss']} | {r['eval']} | " + " | ".join(f"{v:.1f}" for v in r["iou"].values())
                  + f" | {r['miou']:.1f} | {r['train_s']:.0f} |")
        for ev in dict.fromkeys(r["eval"] for r in rows):
            diffs = []
            for seed in args.seeds.split(","):
                by = {r["loss"]: r for r in rows if r["seed"] == int(seed) and r["eval"] == ev}
                if "mars" in by and "ce" in by:
                    diffs.append([by["mars"]["iou"][names[c]] - by["ce"]["iou"][names[c]] for c in w.problematic])
            if diffs:
                print(f"MARS - CE ({ev}), " + ", ".join(names[c] for c in w.problematic) + " per seed: "
                      + "; ".join(" ".join(f"{d:+.1f}" for d in row) for row in diffs))


if __name__ == "__main__":
    main()
