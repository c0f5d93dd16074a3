"""``mars demo``: the whole method on the built-in biased world, in a few minutes on a CPU.

1. generate the world (:mod:`mars_plugin.worlds.synthetic_scenes`): boat leaks into sea, train into rail;
2. ``select_centroids`` on the training pseudo labels, ``debias_labels`` (CRF) on every image;
3. train a small segmentation network twice, plain CE on the pseudo labels and MARS
   (``complement_labels`` with an EMA teacher + ``WCELoss``) on the debiased labels;
4. compare (a) pseudo labels, (b) debiased labels, (c) plain CE, (d) MARS on held-out images:
   one per-class IoU/FP/FN table, ``metrics.json``, a bar chart and overlays under ``--out``;
5. with the world written: ``report_html/report.html``, the held-out images to browse.

``--out`` is the demo's own folder: every file it writes is listed in ``mars_demo_manifest.json``
(before it is written), a re-run deletes exactly the files of the previous run's manifest (so no
stale world file or picture survives), and a non-empty folder without a manifest is refused.
The world is written split, ``world/train/`` and ``world/val/`` (the held-out images), so that
the folder commands reproduce the table's columns (a) and (b) (see ``world/split.json``).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin.commands.demo_settings import DemoSettings
from mars_plugin.method.complement import complement_labels
from mars_plugin.method.debias import debias_labels
from mars_plugin.method.ema import EMATeacher
from mars_plugin.formats.files import atomic_write, write_label
from mars_plugin.method.losses import WCELoss
from mars_plugin.commands.metrics import confusion_matrix, format_scores_table, segmentation_scores
from mars_plugin.method.selection import select_centroids

__all__ = ["TinySegNet", "train_segmenter", "predict", "run_demo", "MANIFEST", "DemoFolderError"]

#: The list of files a ``mars demo`` run wrote into its ``--out`` folder (relative paths).
MANIFEST = "mars_demo_manifest.json"
#: The folder of the demo's ``report.html`` (``mars report`` on the held-out images).
HTML_DIR = "report_html"

# The pseudo labels' boundary noise: CAM-like, spilling over an object's boundary more often than
# falling short of it. MARS removes a spilled rim (it looks like the background) but cannot restore an
# eroded one (the teacher only fills removed pixels); with as many erosions as dilations (the
# generator's default) the debiased labels of dog/car/person/bird were one-sidedly shrunk (0.82 of
# the ground-truth area against 0.89 for the pseudo labels) and MARS learned thin and small objects
# one rim too small (person -1.8, bird -7.5 IoU against plain CE at seed 0).
WORLD_NOISE = dict(erode_rate=0.1, dilate_rate=0.5)

# Images per debias_labels call: 64 of 64x64 pixels are one lattice of the dense CRF.
DEBIAS_BATCH = 64


class TinySegNet(nn.Module):
    """A small fully convolutional segmenter (dilated 3x3 stack, receptive field ~60 px).

    Large enough to learn context (and so to copy a biased label from its pseudo labels),
    small enough to train in tens of seconds on two CPU cores.
    """

    def __init__(self, num_outputs: int, width: int = 32) -> None:
        super().__init__()
        # A stride-2 stem halves the grid (4x cheaper), the dilated stack sees ~60 px of context,
        # and the logits are up-sampled back to the input size, as DeepLab does.
        layers: List[nn.Module] = [nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False),
                                   nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        for dilation in (1, 2, 4, 8, 1):
            layers += [nn.Conv2d(width, width, 3, padding=dilation, dilation=dilation, bias=False),
                       nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        layers.append(nn.Conv2d(width, num_outputs, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.net(x), size=x.shape[-2:], mode="bilinear", align_corners=False)


def _to_input(images_u8: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float, roughly zero-centred."""
    return images_u8.permute(0, 3, 1, 2).float().div(255.0).sub(0.5).div(0.25)


def train_segmenter(
    images: torch.Tensor,
    targets: torch.Tensor,
    image_classes: torch.Tensor,
    num_classes: int,
    *,
    mars: bool,
    epochs: int = 20,
    batch_size: int = 16,
    lr: float = 3e-3,
    momentum: float = 0.99,
    seed: int = 0,
    progress: bool = True,
    desc: str = "train",
) -> nn.Module:
    """Train :class:`TinySegNet` with plain CE (``mars=False``, targets may hold 255) or with MARS
    (``mars=True``: targets are debiased labels with -1, complemented each step by an EMA
    teacher, loss = WCE). Deterministic for a seed. Returns the trained student in both cases
    (so that the two runs differ only in their labels and loss), in eval mode."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = TinySegNet(num_classes + 1)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    n = images.shape[0]
    steps = epochs * ((n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.2)
    teacher = EMATeacher(model, momentum=momentum) if mars else None
    wce = WCELoss()
    it = range(epochs)
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc=desc, unit="epoch")
    for _ in it:
        model.train()
        perm = torch.randperm(n, generator=g)
        for s in range(0, n, batch_size):
            idx = perm[s : s + batch_size]
            x = _to_input(images[idx])
            y = targets[idx]
            flip = torch.rand(len(idx), generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            y = torch.where(flip[:, None, None], y.flip(-1), y)
            logits = model(x)
            if teacher is not None:
                y_co, w = complement_labels(y, teacher(x).softmax(1), image_classes[idx])
                loss = wce(logits, y_co, w)
            else:
                loss = F.cross_entropy(logits, y, ignore_index=255)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if teacher is not None:
                teacher.update(model)
    model.eval()
    return model


@torch.no_grad()
def predict(model: nn.Module, images: torch.Tensor, batch_size: int = 64) -> torch.Tensor:
    """(N, H, W) argmax predictions over all classes (no image-level labels at test time)."""
    model.eval()
    out = [model(_to_input(images[s : s + batch_size])).argmax(1) for s in range(0, images.shape[0], batch_size)]
    return torch.cat(out)


class DemoFolderError(FileExistsError):
    """``--out`` holds files that ``mars demo`` did not write (no manifest), or a bad manifest."""


class _Manifest:
    """The files of one demo run, relative to ``--out``; saved (atomically) *before* the files
    they name are written, so that an interrupted run is cleaned up by the next one too."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files: List[str] = []

    def add(self, paths) -> None:
        known = set(self.files)
        for p in paths:
            rel = Path(p).relative_to(self.root).as_posix()
            if rel not in known:
                self.files.append(rel)
                known.add(rel)
        self._save()

    def prune(self, folder: str) -> None:
        """Drop the files under ``folder`` listed ahead that the run did not write (a picture with
        nothing to draw)."""
        self.files = [f for f in self.files if not f.startswith(folder + "/") or (self.root / f).is_file()]
        self._save()

    def _save(self) -> None:
        text = json.dumps({"written_by": "mars demo", "files": self.files}, indent=1) + "\n"
        atomic_write(self.root / MANIFEST, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def _clear_previous_run(out_dir: Path) -> None:
    """Delete the files a previous demo run listed in ``out_dir``'s manifest (and the folders
    that this leaves empty); refuse a non-empty ``out_dir`` without a manifest. Files the demo
    did not write (e.g. ``mars report --out <out>/report``) are never touched."""
    if out_dir.exists() and not out_dir.is_dir():
        raise NotADirectoryError(f"--out {str(out_dir)!r} exists and is not a folder")
    if not out_dir.is_dir():
        return
    manifest = out_dir / MANIFEST
    if not manifest.is_file():
        if any(out_dir.iterdir()):
            raise DemoFolderError(
                f"--out {str(out_dir)!r} is not empty and has no {MANIFEST}, so mars demo did not write it "
                f"(or an older version did); choose a new or empty folder, or delete this one yourself"
            )
        return
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ValueError("'files' is not a list of str")
    except (ValueError, KeyError, TypeError) as e:
        raise DemoFolderError(f"{manifest} is not a mars demo manifest ({e}); delete the folder yourself") from e
    root = out_dir.resolve()
    dirs = set()
    for rel in files:
        p = out_dir / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not p.resolve().is_relative_to(root):
            raise DemoFolderError(f"{manifest} names {rel!r}, outside {str(out_dir)!r}; delete the folder yourself")
        if p.is_file() or p.is_symlink():
            p.unlink()
        for parent in Path(rel).parents:
            if parent != Path("."):
                dirs.add(parent)
    for d in sorted(dirs, key=lambda d: -len(d.parts)):  # deepest first; only folders left empty
        try:
            (out_dir / d).rmdir()
        except OSError:
            pass
    manifest.unlink()


def _world_files(world_root: Path, stems: List[str]) -> List[Path]:
    """The files :func:`mars_plugin.worlds.synthetic.write_world` and the demo write for ``stems``."""
    out = [world_root / n for n in ("image_labels.json", "classes.json")]
    for stem in stems:
        out += [world_root / "images" / f"{stem}.png", world_root / "labels" / f"{stem}.png",
                world_root / "gt" / f"{stem}.png", world_root / "features" / f"{stem}.npy",
                world_root / "debiased" / f"{stem}.png"]
    return out


def _overlay_rows(names, val, db_val, pred_plain, pred_mars, examples_per_class: int):
    """Up to ``examples_per_class`` held-out images per class, each image at most once (an image
    of two classes counts for the first class that picks it): image | ground truth | WSSS pseudo
    | removed | plain CE | MARS."""
    from mars_plugin.pictures import label_images
    rows, used = [], set()
    for c in range(1, len(names)):
        members = [i for i in range(val.num_images) if bool(val.image_classes[i, c - 1]) and i not in used]
        for i in members[:examples_per_class]:
            used.add(i)
            img = val.images[i].numpy()
            classes = ", ".join(names[k] for k in val.class_ids(i))
            rows.append((f"{names[c]}: {val.stems[i]} (classes: {classes})", [
                ("image", img),
                # labels unblended, in the legend's exact colours (as mars report's panels)
                ("ground truth", val.gt[i]),
                ("WSSS pseudo", val.pseudo[i]),
                ("removed", label_images.removed_mask_image(img, val.pseudo[i], db_val[i], tint=1.0)),
                ("plain CE", pred_plain[i]),
                ("MARS", pred_mars[i]),
            ]))
    return rows


def _scores(pred: torch.Tensor, gt: torch.Tensor, num_classes: int) -> Dict[str, object]:
    return segmentation_scores(confusion_matrix(pred, gt, num_classes))


def run_demo(
    out: str = "mars_demo",
    *,
    seed: int = 0,
    num_train: int = 240,
    num_val: int = 80,
    size: int = 64,
    epochs: int = 20,
    refine: str = "crf",
    crf_params: Union[None, str, Mapping[str, Any]] = "mars",
    write_world: bool = True,
    progress: bool = True,
    examples_per_class: int = 2,
    settings: Optional[DemoSettings] = None,
) -> Dict[str, object]:
    """Run the demo, print the table, write pictures and ``metrics.json``; returns the metrics.
    The keywords are :class:`~mars_plugin.commands.demo_settings.DemoSettings`' fields, or give
    the record as ``settings`` (``mars demo`` does) and leave them out."""
    given = dict(seed=seed, num_train=num_train, num_val=num_val, size=size, epochs=epochs, refine=refine,
                 crf_params=crf_params, write_world=write_world, progress=progress,
                 examples_per_class=examples_per_class)
    from mars_plugin.commands.job_settings import own_record

    if own_record("run_demo", DemoSettings, settings) is None:
        return _demo(DemoSettings(**given), out)
    changed = sorted(k for k, v in given.items() if v != DemoSettings.__dataclass_fields__[k].default)
    if changed:
        raise ValueError(f"give settings=DemoSettings(...) or its fields as keywords, not both (got {changed})")
    return _demo(settings, out)


class _Clock:
    """The seconds of each stage, printed as they end and kept for ``metrics.json``."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.timings: Dict[str, float] = {}

    def lap(self, name: str, t0: float) -> None:
        self.timings[name] = round(time.perf_counter() - t0, 2)
        print(f"[mars demo] {name}: {self.timings[name]:.1f} s", flush=True)


@dataclass
class _Demo:
    """One demo run: its settings, folder and manifest, and what the stages made so far."""

    s: DemoSettings
    out_dir: Path
    manifest: _Manifest
    clock: _Clock = field(default_factory=_Clock)
    world: Any = None
    train: Any = None
    val: Any = None
    centroids: Any = None
    db_train: Optional[torch.Tensor] = None
    db_val: Optional[torch.Tensor] = None


def _demo(s: DemoSettings, out: Union[str, os.PathLike]) -> Dict[str, object]:
    """The demo's stages on checked settings (:func:`run_demo` and ``mars demo``)."""
    clock = _Clock()
    out_dir = Path(out)
    _clear_previous_run(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    run = _Demo(s, out_dir, _Manifest(out_dir), clock)
    _make_world(run)
    _select(run)
    _debias(run)
    pred_plain, pred_mars = _train_both(run)
    columns = _score(run, pred_plain, pred_mars)
    _pictures(run, columns, pred_plain, pred_mars)
    if s.write_world:
        _write_world_folders(run)
        _html_report(run, columns)
    return _write_metrics(run, columns)


def _html_report(run: _Demo, columns: Mapping[str, Any]) -> None:
    """``report_html/``: ``mars report`` on the held-out images (``world/val``), with their ground
    truth, the table's columns (a) and (b) and the centroid ranking: ``report.html`` to browse."""
    from mars_plugin.commands.report import report_job
    from mars_plugin.commands.report_html import HtmlExtras
    from mars_plugin.commands.reproduce_report import PICTURES
    from mars_plugin.pictures.html_report import DATA_NAME, PAGE_NAME
    from mars_plugin.pictures.report_thumbnails import thumb_names

    t0, val, out = time.perf_counter(), run.out_dir / "world" / "val", run.out_dir / HTML_DIR
    names = ["report.json", PAGE_NAME, DATA_NAME] + [name for _, name in PICTURES]
    names += [p for i in range(len(run.val.stems)) for p in thumb_names(i, True).values()]
    run.manifest.add([out / n for n in names])  # before they are written; then what was not drawn is dropped
    extras = HtmlExtras(gt_dir=val / "gt", centroids=run.centroids, title="mars demo: held-out images (world/val)",
                        scores={"pseudo": columns["(a) WSSS pseudo"], "debiased": columns["(b) debiased"]})
    report_job(val / "labels", val / "debiased", val / "images", out, html=extras,
               class_names=list(run.world.class_names), progress=False)
    run.manifest.prune(HTML_DIR)
    run.clock.lap("report.html", t0)


def _make_world(run: _Demo) -> None:
    """The built-in world, split into the training and the held-out images."""
    from mars_plugin.worlds.synthetic_scenes import make_world

    s, t0 = run.s, time.perf_counter()
    world = make_world(s.num_train + s.num_val, size=s.size, seed=s.seed, **WORLD_NOISE)
    # The features as world/*/features/*.npy store them (float16), so that the folder commands
    # on the written world compute exactly what the demo computed.
    world.features = world.features.half().float()
    run.world = world
    run.train = world.subset(list(range(s.num_train)))
    run.val = world.subset(list(range(s.num_train, s.num_train + s.num_val)))
    run.clock.lap("world", t0)


def _select(run: _Demo) -> None:
    """``select_centroids`` on the training pseudo labels, saved as ``centroids.pt``."""
    t0 = time.perf_counter()
    run.centroids = select_centroids(zip(run.train.features, run.train.pseudo), run.world.num_classes,
                                     seed=run.s.seed, progress=run.s.progress, total=run.s.num_train)
    run.manifest.add([run.out_dir / "centroids.pt"])
    run.centroids.save(run.out_dir / "centroids.pt")
    run.clock.lap("select_centroids", t0)


def _debias(run: _Demo) -> None:
    """``debias_labels`` on every image, :data:`DEBIAS_BATCH` at a time."""
    s, world, t0 = run.s, run.world, time.perf_counter()
    debiased = []
    it = range(0, len(world.stems), DEBIAS_BATCH)
    if s.progress:
        from tqdm.auto import tqdm

        it = tqdm(it, desc="debias_labels", unit="batch")
    for start in it:
        part = slice(start, start + DEBIAS_BATCH)
        debiased.append(debias_labels(world.features[part], world.pseudo[part], run.centroids,
                                      world.image_classes[part], image=world.images[part], refine=s.refine,
                                      crf_params=s.crf_params))
    debiased_t = torch.cat(debiased)
    run.clock.lap("debias_labels", t0)
    run.db_train, run.db_val = debiased_t[:s.num_train], debiased_t[s.num_train:]


def _train_both(run: _Demo) -> Tuple[torch.Tensor, torch.Tensor]:
    """Plain CE on the pseudo labels and MARS on the debiased ones; their held-out predictions."""
    s, train, C = run.s, run.train, run.world.num_classes
    t0 = time.perf_counter()
    plain = train_segmenter(train.images, train.pseudo, train.image_classes, C, mars=False, epochs=s.epochs,
                            seed=s.seed, progress=s.progress, desc="train plain CE")
    run.clock.lap("train plain CE", t0)
    t0 = time.perf_counter()
    mars_net = train_segmenter(train.images, run.db_train, train.image_classes, C, mars=True, epochs=s.epochs,
                               seed=s.seed, progress=s.progress, desc="train MARS")
    run.clock.lap("train MARS", t0)
    return predict(plain, run.val.images), predict(mars_net, run.val.images)


def _score(run: _Demo, pred_plain: torch.Tensor, pred_mars: torch.Tensor) -> Dict[str, Dict[str, object]]:
    """The four columns' scores on the held-out images, printed as one table."""
    val, C, names = run.val, run.world.num_classes, list(run.world.class_names)
    columns = {
        "(a) WSSS pseudo": _scores(val.pseudo, val.gt, C),
        "(b) debiased": _scores(run.db_val, val.gt, C),
        "(c) plain CE": _scores(pred_plain, val.gt, C),
        "(d) MARS": _scores(pred_mars, val.gt, C),
    }
    table = format_scores_table(names, columns)
    print(f"\nPer-class IoU (%), FP, FN on {run.s.num_val} held-out images (problematic: "
          f"{', '.join(names[c] for c in run.world.problematic)}):\n{table}\n")
    return columns


def _pictures(run: _Demo, columns: Mapping[str, Any], pred_plain: torch.Tensor, pred_mars: torch.Tensor) -> None:
    """A bar chart of IoU and overlays of a few held-out images per class (each image once)."""
    from mars_plugin.pictures import bar_charts, panel_grids

    out_dir, names, world = run.out_dir, list(run.world.class_names), run.world
    run.manifest.add([out_dir / "iou_per_class.png", out_dir / "overlays.png", out_dir / "metrics.json"])
    series = {k: [100 * v for v in s["iou"]] for k, s in columns.items()}
    bar_charts.save_iou_bar_chart(out_dir / "iou_per_class.png", names, series,
                                  title="Per-class IoU on held-out images: WSSS vs MARS", highlight=list(world.problematic),
                                  highlight_note="* problematic classes (biased objects in the pseudo labels)")
    rows = _overlay_rows(names, run.val, run.db_val, pred_plain, pred_mars, run.s.examples_per_class)
    panel_grids.save_overlay_grid(out_dir / "overlays.png", rows, legend=panel_grids.class_legend(names))


def _write_world_folders(run: _Demo) -> None:
    """``world/train`` and ``world/val`` (with their debiased labels), ``classes.json``, ``split.json``."""
    from mars_plugin.worlds.synthetic import write_world

    t0 = time.perf_counter()
    world_dir = run.out_dir / "world"
    parts = {"train": (run.train, run.db_train), "val": (run.val, run.db_val)}
    run.manifest.add([world_dir / "split.json", world_dir / "classes.json"]
                     + [p for k, (w, _) in parts.items() for p in _world_files(world_dir / k, w.stems)])
    for k, (w, db) in parts.items():
        paths = write_world(w, world_dir / k, overwrite=True)
        for i, stem in enumerate(w.stems):
            write_label(world_dir / k / "debiased" / f"{stem}.png", db[i])
    classes_text = (paths["classes"]).read_text(encoding="utf-8")
    atomic_write(world_dir / "classes.json", lambda tmp: Path(tmp).write_text(classes_text, encoding="utf-8"))
    split = {
        "train": run.train.stems, "val": run.val.stems,
        "columns": {
            "(a) WSSS pseudo": "world/val/labels against world/val/gt",
            "(b) debiased": "world/val/debiased (centroids of world/train) against world/val/gt",
            "(c) plain CE, (d) MARS": "networks trained on world/train, predictions on world/val against world/val/gt",
        },
    }
    atomic_write(world_dir / "split.json", lambda tmp: Path(tmp).write_text(json.dumps(split, indent=1) + "\n",
                                                                            encoding="utf-8"))
    run.clock.lap("write world", t0)


def _write_metrics(run: _Demo, columns: Mapping[str, Any]) -> Dict[str, object]:
    """``metrics.json`` (the settings, the scores, the centroids, the timings); says what was written."""
    s, V, out_dir = run.s, run.centroids, run.out_dir
    names, problematic = list(run.world.class_names), run.world.problematic
    metrics = {
        "config": dict(seed=s.seed, num_train=s.num_train, num_val=s.num_val, size=s.size, epochs=s.epochs,
                       refine=s.refine, world_noise=dict(WORLD_NOISE), crf_params=s.params,
                       alpha=V.config["alpha"], k_fg=V.config["k_fg"], k_bg=V.config["k_bg"]),
        "class_names": names,
        "problematic": [names[c] for c in problematic],
        "scores": columns,
        "problematic_iou": {names[c]: {k: columns[k]["iou"][c] for k in columns} for c in problematic},
        "centroids": {names[c]: {"candidates": int(V.num_candidates[c]), "selected": int(V.num_selected[c]),
                                 "cut_distance": float(V.cut_distance[c])}
                      for c in range(1, run.world.num_classes + 1) if bool(V.valid[c])},
        "timings_s": run.clock.timings,
        "world": ({"train": "world/train", "val": "world/val", "split": "world/split.json"} if s.write_world else None),
    }
    metrics["timings_s"]["total"] = round(time.perf_counter() - run.clock.start, 2)
    atomic_write(out_dir / "metrics.json", lambda tmp: Path(tmp).write_text(json.dumps(metrics, indent=2)))
    print(f"[mars demo] wrote {out_dir}/metrics.json, iou_per_class.png, overlays.png, centroids.pt"
          + (f", {HTML_DIR}/report.html (open it in a browser)" if s.write_world else "")
          + (f", world/train and world/val (try: mars report --labels {out_dir}/world/train/labels --debiased "
             f"{out_dir}/world/train/debiased --images {out_dir}/world/train/images --out {out_dir}/report "
             f"--class-names {out_dir}/world/classes.json)" if s.write_world else ""))
    print(f"[mars demo] total {metrics['timings_s']['total']:.1f} s")
    return metrics


def run_demo_command(args: Any) -> None:
    """``mars demo``: :func:`run_demo` on :class:`DemoSettings` made from the parsed flags."""
    run_demo(args.out, settings=DemoSettings.from_args(args))
