"""``mars report``: which classes were biased, as ``report.json``, a bar chart and overlay grids."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin._checks import check_class_names, check_ignore_byte
from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, find_image, read_image, read_label
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, _check_on_error, _fail, one_line
from mars_plugin.commands.inputs import (
    _check_out_dir,
    check_out_apart,
    _progress,
    _stems,
    check_images_folder,
    check_input_folder,
    check_job_params,
    check_label_values,
)
from mars_plugin.commands.debias import _removed_per_class
from mars_plugin.commands.label_formats import _class_names

__all__ = ["report_job", "run_report_command"]


#: What ``share_removed`` means, written on the chart and into ``report.json``.
SHARE_DEFINITION = ("share of the class's pseudo-label pixels that MARS marked biased, over the whole set: "
                    "removed pixels of class c / pixels labelled c in the pseudo labels (all images summed)")


def _px(n: int) -> str:
    """A pixel count in a few characters: 950 px, 12.3k px, 4.5M px."""
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= div:
            return f"{n / div:.1f}{unit} px"
    return f"{n} px"


def report_job(
    labels_dir: os.PathLike,
    debiased_dir: os.PathLike,
    images_dir: os.PathLike,
    out_dir: os.PathLike,
    *,
    class_names: Optional[Sequence[str]] = None,
    num_examples: int = 8,
    per_class: int = 2,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
) -> Tuple[Dict[str, object], JobSummary]:
    """Which classes were biased: per-class share of pseudo-label pixels marked biased.

    Writes into ``out_dir``:

    * ``report.json``: per class its pseudo-label ``pixels``, ``removed`` pixels,
      ``share_removed`` (removed / pixels, over the whole set: :data:`SHARE_DEFINITION`) and
      ``pixel_share`` (its share of all foreground pseudo-label pixels, so that a small class
      is seen as small); the ``ranking`` by ``share_removed``; the ``most_changed`` images; and
      ``per_class_examples``;
    * ``biased_share.png``: bar chart, classes ranked, each with its pixel count under its name
      and the definition of the share under the chart;
    * ``most_changed.png``: overlays of the ``num_examples`` images with the largest share of
      removed foreground pixels (none when 0);
    * ``per_class.png``: for each class in ranking order (the first :data:`MAX_GRID_CLASSES`),
      its ``per_class`` images with the largest share of that class's pixels removed (ties: more
      removed pixels first), only images where some were removed (none when 0).

    Both overlay grids carry a colour legend (class name -> colour, removed, ignore) and draw every
    label in its exact colours: the label panels unblended, beside the image; their
    panels are at most :data:`PANEL_SIDE` pixels on the longer side. One run at a time writes
    into ``out_dir`` (a lock, :class:`~mars_plugin.runs.run_lock.RunLock`); holding it, the run
    removes the ``.tmp-*`` files a killed run left there.
    """
    check_out_apart(out_dir, "--out", {"--labels": labels_dir, "--debiased": debiased_dir, "--images": images_dir})
    _check_on_error(on_error)
    p = check_job_params(num_examples=num_examples, per_class=per_class)
    num_examples, per_class = p["num_examples"], p["per_class"]
    if class_names is not None:
        class_names = check_class_names(class_names)
    ignore_index = check_ignore_byte(ignore_index, num_classes=None if class_names is None else len(class_names) - 1)
    stems = _stems(debiased_dir, flag="--debiased")
    check_input_folder(labels_dir, "--labels", stems, (".png",), "pseudo-label", of="debiased labels")
    check_images_folder(images_dir, stems, labels_dir=labels_dir, of="debiased labels")
    summary = JobSummary()
    total: Dict[int, int] = {}
    removed: Dict[int, int] = {}
    per_image: List[Tuple[float, str]] = []
    max_class = BIASED_VALUE - 1 if class_names is None else len(class_names) - 1
    flag = "the labels' range" if class_names is None else f"--class-names ({len(class_names)} names)"
    per_class_images: Dict[int, List[Tuple[float, int, int, str]]] = {}  # c -> (share, removed, pixels, stem)
    for stem in _progress(stems, len(stems), "report", progress):
        try:
            y_path = Path(labels_dir) / f"{stem}.png"
            y = read_label(y_path, biased_value=None)
            check_label_values(y, y_path, max_class, ignore_index, flag=flag)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            if y.shape != d.shape:
                raise ValueError(f"pseudo label {tuple(y.shape)} and debiased label {tuple(d.shape)} differ in size")
            _probe_image(find_image(images_dir, stem), tuple(y.shape))
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        counts = _removed_per_class(y, d, ignore_index)  # the same count as debias prints
        for c, (t_c, r_c) in counts.items():
            total[c] = total.get(c, 0) + t_c
            removed[c] = removed.get(c, 0) + r_c
            if r_c:
                per_class_images.setdefault(c, []).append((r_c / t_c, r_c, t_c, stem))
        fg_pixels = sum(t for t, _ in counts.values())
        if fg_pixels:
            per_image.append((sum(r for _, r in counts.values()) / fg_pixels, stem))
        summary.done += 1
    if not total:
        raise JobError(f"--labels {labels_dir}: no foreground pixel in any pseudo label read ({summary.done}): "
                       "nothing to report")
    num_classes = max(total)
    if class_names is None:
        class_names = ["background"] + [f"class {c}" for c in range(1, num_classes + 1)]
    if len(class_names) < num_classes + 1:
        raise ValueError(f"--class-names has {len(class_names)} names but labels reach class {num_classes}")
    share = [float("nan")] + [removed.get(c, 0) / total[c] if c in total else float("nan") for c in range(1, num_classes + 1)]
    ranking = sorted((c for c in range(1, num_classes + 1) if c in total), key=lambda c: -share[c])
    per_image.sort(key=lambda t: (-t[0], t[1]))
    examples = per_image[:num_examples]
    class_examples = {c: sorted(per_class_images.get(c, []), key=lambda t: (-t[0], -t[1], t[3]))[:per_class]
                      for c in ranking}
    all_fg = sum(total.values())

    out = Path(out_dir)
    _check_out_dir(out, "--out")
    from mars_plugin.runs.run_lock import LOCK_NAME, RunLock, remove_stale_tmp

    # One run at a time writes here; holding the lock, the .tmp-* files a killed run left are
    # stale: remove them.
    lock = RunLock(out / LOCK_NAME, f"--out {out}", "mars report").acquire()
    remove_stale_tmp(out)
    # Every output is written to a temporary file first and renamed at the end, report.json
    # last: a failure never leaves a chart without its report.json.
    staged: Dict[str, str] = {}

    def stage(name: str) -> str:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=Path(name).suffix, dir=out)
        os.close(fd)
        staged[name] = tmp
        return tmp

    try:
        _report_outputs(stage, class_names, num_classes, share, total, ranking, examples, class_examples,
                        images_dir, labels_dir, debiased_dir, on_error, summary)
        report = {
            "share_definition": SHARE_DEFINITION,
            "classes": {class_names[c]: {"id": c, "pixels": total.get(c, 0), "removed": removed.get(c, 0),
                                         "share_removed": share[c], "pixel_share": total.get(c, 0) / all_fg}
                        for c in range(1, num_classes + 1) if c in total},
            "ranking": [class_names[c] for c in ranking],
            "most_changed": [{"stem": s, "share_removed": f} for f, s in examples],
            "per_class_examples": {class_names[c]: [{"stem": s, "share_removed": f, "removed": r, "pixels": t}
                                                    for f, r, t, s in class_examples[c]] for c in ranking},
            "num_images": summary.done,
        }
        Path(stage("report.json")).write_text(json.dumps(report, indent=2))
        umask = os.umask(0)
        os.umask(umask)
        for name in sorted(staged, key=lambda n: n == "report.json"):  # report.json last
            os.chmod(staged[name], 0o666 & ~umask)
            os.replace(staged[name], out / name)
    finally:
        for tmp in staged.values():
            if os.path.exists(tmp):
                os.unlink(tmp)
        lock.release()
    return report, summary


def _probe_image(path: Path, shape: Tuple[int, int]) -> None:
    """Open an image's header (not its pixels): refuses a file PIL cannot identify, a
    decompression bomb, and an image whose size differs from the label's."""
    from PIL import Image

    try:
        with Image.open(path) as im:
            w, h = im.size
    except Exception as e:  # noqa: BLE001 -- any failure to open it is a bad file
        raise ValueError(f"{path}: cannot read image ({one_line(e)})") from None
    if (h, w) != shape:
        raise ValueError(f"image {path} {w}x{h} and pseudo label {shape[1]}x{shape[0]} (width x height) differ in size")


#: Longest side of a panel in the report's overlay grids. Photographs (VOC/COCO: 500-640 px) are
#: shrunk to it and small images are enlarged up to 3x towards it: at three times a 500 px photo,
#: a VOC per-class grid (20 classes x 2 rows x 4 panels) was 271 megapixels, past PIL's
#: decompression-bomb limit for anyone opening it.
PANEL_SIDE = 256
#: per_class.png shows the classes with the largest share removed first, at most this many (all
#: of them stay in report.json): 80 COCO classes of two rows each would be a grid no one reads.
MAX_GRID_CLASSES = 24


def _fit_panel(img: np.ndarray, y: torch.Tensor, d: torch.Tensor) -> Tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """Shrink an image and its two label maps to at most :data:`PANEL_SIDE` on the longer side
    (bilinear for the image, nearest for the labels); smaller images are returned as they are."""
    H, W = y.shape
    f = PANEL_SIDE / max(H, W)
    if f >= 1:
        return img, y, d
    from PIL import Image

    size = (max(1, round(W * f)), max(1, round(H * f)))
    small = np.asarray(Image.fromarray(img).resize(size, Image.BILINEAR))

    def nearest(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.interpolate(t[None, None].float(), size=size[::-1], mode="nearest")[0, 0].to(t.dtype)

    return small, nearest(y), nearest(d)


def _report_outputs(stage, class_names, num_classes, share, total, ranking, examples, class_examples,
                    images_dir, labels_dir, debiased_dir, on_error, summary) -> None:
    """The chart and the overlays of :func:`report_job`, each written to ``stage(name)``."""
    from mars_plugin.pictures import bar_charts, label_images, panel_grids
    bar_charts.save_iou_bar_chart(
        stage("biased_share.png"), list(class_names[1 : num_classes + 1]),
        {"pixels marked biased (% of the class's pseudo-label pixels)": [100 * s for s in share[1:]]},
        title=f"Which classes were biased (MARS), {summary.done} images", ylabel="marked biased (%)",
        order=[c - 1 for c in ranking],
        note=f"Share = {SHARE_DEFINITION}. Under each name: its pseudo-label pixels (a small class can rank "
             f"high on few pixels).",
        tick_notes=[_px(total.get(c, 0)) for c in range(1, num_classes + 1)],
    )
    panels: Dict[str, Tuple[List[Tuple[str, Any]], set]] = {}  # stem -> (panels, classes in its pseudo label)
    bad: set = set()

    def overlay(stem: str, caption: str) -> Optional[Tuple[str, Any]]:
        if stem in bad:
            return None
        if stem not in panels:
            try:
                img = read_image(find_image(images_dir, stem))
            except FILE_ERRORS as e:  # a truncated image passes the header probe
                bad.add(stem)
                _fail(stem, e, on_error, summary)
                return None
            y = read_label(Path(labels_dir) / f"{stem}.png", biased_value=None)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            img, y, d = _fit_panel(img, y, d)
            # Label panels unblended, and the removed panel's labelled pixels untinted: every colour
            # is then the legend's exactly (blending with the image changes it); the image is beside.
            panels[stem] = ([
                ("image", img), ("pseudo label", y),
                ("removed pixels", label_images.removed_mask_image(img, y, d, tint=1.0)),
                ("debiased label", d),
            ], {c for c in torch.unique(y).tolist() if 0 < c <= num_classes})
        return caption, panels[stem][0]

    def save_grid(name: str, captioned: List[Tuple[str, str]]) -> None:
        rows = [(stem, row) for stem, caption in captioned if (row := overlay(stem, caption)) is not None]
        if rows:  # legend: background, the classes drawn, removed, ignore
            shown = sorted(set().union(*(panels[s][1] for s, _ in rows)))
            side = max(max(np.asarray(p).shape[:2]) for _, (_, row) in rows for _, p in row)
            panel_grids.save_overlay_grid(stage(name), [row for _, row in rows], scale=max(1, min(3, PANEL_SIDE // side)),
                                          legend=panel_grids.class_legend(list(class_names), [0] + shown))

    save_grid("most_changed.png", [(stem, f"{stem}: {100 * frac:.0f}% of its foreground pixels removed")
                                   for frac, stem in examples])
    save_grid("per_class.png", [(stem, f"{class_names[c]}: {stem}: {100 * f:.0f}% of its {class_names[c]} "
                                       f"pixels removed ({r} of {t})")
                                for c in ranking[:MAX_GRID_CLASSES] for f, r, t, stem in class_examples[c]])


def run_report_command(args: argparse.Namespace) -> JobSummary:
    """``mars report``: :func:`report_job` on the parsed flags, then the classes ranked on stdout."""
    progress = not args.no_progress
    report, s = report_job(
        args.labels, args.debiased, args.images, args.out, class_names=_class_names(args.class_names),
        num_examples=args.num_examples, per_class=args.per_class, ignore_index=args.ignore_index, on_error=args.on_error, progress=progress,
    )
    print("classes ranked by the share of their pseudo-label pixels marked biased (all images summed):")
    width = max((len(n) for n in report["ranking"]), default=0)
    for name in report["ranking"]:
        c = report["classes"][name]
        print(f"  {name:<{width}}  {100 * c['share_removed']:5.1f}% of {c['pixels']:,} pixels "
              f"({100 * c['pixel_share']:.1f}% of all foreground pixels)")
    print(f"report -> {args.out}; {s.line('read')}")
    return s
