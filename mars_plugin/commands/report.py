"""``mars report``: which classes were biased, as ``report.json``, a bar chart and overlay grids."""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.formats.files import BIASED_VALUE, find_image, read_image, read_label
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, _fail, one_line
from mars_plugin.commands.inputs import (
    _check_out_dir,
    check_out_apart,
    _progress,
    _stems,
    check_images_folder,
    check_input_folder,
    check_label_values,
)
from mars_plugin.commands.debias import _removed_per_class
from mars_plugin.commands.report_html import HtmlExtras
from mars_plugin.commands.report_settings import ReportSettings

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
    settings: Optional[ReportSettings] = None,
    html: Optional[HtmlExtras] = None,
    **keywords: Any,
) -> Tuple[Dict[str, object], JobSummary]:
    """Which classes were biased: per-class share of pseudo-label pixels marked biased.

    ``settings``: a :class:`~mars_plugin.commands.report_settings.ReportSettings`, or its fields
    as ``keywords`` (``class_names``, ``num_examples``, ``per_class``, ``ignore_index``,
    ``on_error``, ``progress``).

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
    * ``report.html``, ``report_data.js`` and ``thumbs/``: the page to look through what was
      marked biased, class by class (:mod:`mars_plugin.commands.report_html`; ``html``: its
      ground truth, scores, centroids);
    * ``per_class.png``: for each class in ranking order (the first :data:`MAX_GRID_CLASSES`),
      its ``per_class`` images with the largest share of that class's pixels removed (ties: more
      removed pixels first), only images where some were removed (none when 0).

    Both overlay grids carry a colour legend (class name -> colour, removed, ignore) and draw every
    label in its exact colours: the label panels unblended, beside the image; their
    panels are at most :data:`PANEL_SIDE` pixels on the longer side. One run at a time writes
    into ``out_dir`` (a lock, :class:`~mars_plugin.runs.run_lock.RunLock`); holding it, the run
    removes the ``.tmp-*`` files a killed run left there.
    """
    from mars_plugin.commands.job_settings import own_record

    own_record("report_job", ReportSettings, settings)
    if settings is not None and keywords:
        raise ValueError(f"give settings=ReportSettings(...) or its fields as keywords, not both "
                         f"(got {sorted(keywords)})")
    s = settings if settings is not None else ReportSettings(**keywords)
    check_out_apart(out_dir, "--out", {"--labels": labels_dir, "--debiased": debiased_dir, "--images": images_dir})
    folders = _Folders(Path(labels_dir), Path(debiased_dir), Path(images_dir))
    stems = _stems(debiased_dir, flag="--debiased")
    check_input_folder(labels_dir, "--labels", stems, (".png",), "pseudo-label", of="debiased labels")
    check_images_folder(images_dir, stems, labels_dir=labels_dir, of="debiased labels")
    html = _html_extras(s, html, out_dir, stems)
    tally = _tally(s, folders, stems)
    if not tally.total:
        raise JobError(f"--labels {labels_dir}: no foreground pixel in any pseudo label read ({tally.summary.done}): "
                       "nothing to report")
    ranked = _rank(s, tally)
    out = Path(out_dir)
    _check_out_dir(out, "--out")
    return _write_report(s, folders, tally, ranked, out, _scored(s, folders, tally, ranked, html)), tally.summary


def _html_extras(s: ReportSettings, html: Optional[HtmlExtras], out_dir: os.PathLike,
                 stems: Sequence[str]) -> HtmlExtras:
    """``--gt`` and ``--centroids`` checked (before anything is read) into the page's extras."""
    if html is not None and (s.gt_dir or s.centroids):
        raise ValueError("give gt_dir/centroids as settings or in html=HtmlExtras(...), not both")
    if html is not None:
        return html
    if s.gt_dir is not None:
        check_out_apart(out_dir, "--out", {"--gt": s.gt_dir})
        check_input_folder(s.gt_dir, "--gt", stems, (".png",), "ground-truth", of="debiased labels")
    from mars_plugin.commands.inputs import load_centroids  # the one door: one-line errors naming the flag

    return HtmlExtras(gt_dir=s.gt_dir, centroids=None if s.centroids is None else load_centroids(s.centroids))


def _scored(s: ReportSettings, folders: "_Folders", tally: "_Tally", ranked: "_Ranking", html: HtmlExtras) -> HtmlExtras:
    """``--gt`` given and no scores: the pseudo and debiased labels scored as ``mars evaluate``
    scores them, on the images the report counted."""
    if html.gt_dir is None or html.scores is not None:
        return html
    from dataclasses import replace

    from mars_plugin.commands.evaluate import evaluate_job

    counted = [stem for stem, _ in tally.images]
    scores = {key: evaluate_job(folder, html.gt_dir, len(ranked.class_names) - 1, stems=counted,
                                on_error=s.on_error, progress=False)[0]
              for key, folder in (("pseudo", folders.labels), ("debiased", folders.debiased))}
    return replace(html, scores=scores)


@dataclass(frozen=True)
class _Folders:
    """The folders :func:`report_job` reads: pseudo labels, debiased labels, images."""

    labels: Path
    debiased: Path
    images: Path


@dataclass
class _Tally:
    """What the labels read add up to: per class its pseudo-label pixels (``total``) and of them
    marked biased (``removed``); per image its share of foreground pixels removed
    (``per_image``: (share, stem)); per class the images where some were removed
    (``per_class_images``: c -> (share, removed, pixels, stem)); the job's ``summary``."""

    summary: JobSummary = field(default_factory=JobSummary)
    total: Dict[int, int] = field(default_factory=dict)
    removed: Dict[int, int] = field(default_factory=dict)
    per_image: List[Tuple[float, str]] = field(default_factory=list)
    per_class_images: Dict[int, List[Tuple[float, int, int, str]]] = field(default_factory=dict)
    images: List[Tuple[str, Dict[int, Tuple[int, int]]]] = field(default_factory=list)  # report.html's

    def add(self, stem: str, counts: Dict[int, Tuple[int, int]]) -> None:
        """One image's {class: (pixels, removed)}."""
        self.images.append((stem, dict(counts)))
        for c, (t_c, r_c) in counts.items():
            self.total[c] = self.total.get(c, 0) + t_c
            self.removed[c] = self.removed.get(c, 0) + r_c
            if r_c:
                self.per_class_images.setdefault(c, []).append((r_c / t_c, r_c, t_c, stem))
        fg_pixels = sum(t for t, _ in counts.values())
        if fg_pixels:
            self.per_image.append((sum(r for _, r in counts.values()) / fg_pixels, stem))
        self.summary.done += 1


def _tally(s: ReportSettings, folders: _Folders, stems: Sequence[str]) -> _Tally:
    """Every pair of labels read and counted (a bad file fails alone, ``on_error``)."""
    tally = _Tally()
    max_class = BIASED_VALUE - 1 if s.class_names is None else len(s.class_names) - 1
    flag = "the labels' range" if s.class_names is None else f"--class-names ({len(s.class_names)} names)"
    for stem in _progress(stems, len(stems), "report", s.progress):
        try:
            y_path = folders.labels / f"{stem}.png"
            y = read_label(y_path, biased_value=None)
            check_label_values(y, y_path, max_class, s.ignore_index, flag=flag)
            d = read_label(folders.debiased / f"{stem}.png")
            if y.shape != d.shape:
                raise ValueError(f"pseudo label {tuple(y.shape)} and debiased label {tuple(d.shape)} differ in size")
            _probe_image(find_image(folders.images, stem), tuple(y.shape))
        except FILE_ERRORS as e:
            _fail(stem, e, s.on_error, tally.summary)
            continue
        tally.add(stem, _removed_per_class(y, d, s.ignore_index))  # the same count as debias prints
    return tally


@dataclass(frozen=True)
class _Ranking:
    """The classes ranked by their share removed (``share[c]``; ``nan`` for the background and
    a class never labelled), the ``examples`` (most changed images) and each class's
    ``class_examples``, with the ``class_names`` of classes 0..``num_classes``."""

    class_names: Sequence[str]
    num_classes: int
    share: List[float]
    ranking: List[int]
    examples: List[Tuple[float, str]]
    class_examples: Dict[int, List[Tuple[float, int, int, str]]]


def _rank(s: ReportSettings, tally: _Tally) -> _Ranking:
    """The tally ranked (the names checked against the classes the labels reach)."""
    total, removed = tally.total, tally.removed
    num_classes = max(total)
    class_names = s.class_names
    if class_names is None:
        class_names = ["background"] + [f"class {c}" for c in range(1, num_classes + 1)]
    if len(class_names) < num_classes + 1:
        raise ValueError(f"--class-names has {len(class_names)} names but labels reach class {num_classes}")
    share = [float("nan")] + [removed.get(c, 0) / total[c] if c in total else float("nan") for c in range(1, num_classes + 1)]
    ranking = sorted((c for c in range(1, num_classes + 1) if c in total), key=lambda c: -share[c])
    per_image = sorted(tally.per_image, key=lambda t: (-t[0], t[1]))
    class_examples = {c: sorted(tally.per_class_images.get(c, []), key=lambda t: (-t[0], -t[1], t[3]))[:s.per_class]
                      for c in ranking}
    return _Ranking(class_names, num_classes, share, ranking, per_image[:s.num_examples], class_examples)


def _report_dict(tally: _Tally, r: _Ranking) -> Dict[str, object]:
    """``report.json``'s content."""
    total, removed, names = tally.total, tally.removed, r.class_names
    all_fg = sum(total.values())
    return {
        "share_definition": SHARE_DEFINITION,
        "classes": {names[c]: {"id": c, "pixels": total.get(c, 0), "removed": removed.get(c, 0),
                               "share_removed": r.share[c], "pixel_share": total.get(c, 0) / all_fg}
                    for c in range(1, r.num_classes + 1) if c in total},
        "ranking": [names[c] for c in r.ranking],
        "most_changed": [{"stem": s, "share_removed": f} for f, s in r.examples],
        "per_class_examples": {names[c]: [{"stem": s, "share_removed": f, "removed": n, "pixels": t}
                                          for f, n, t, s in r.class_examples[c]] for c in r.ranking},
        "num_images": tally.summary.done,
    }


def _write_report(s: ReportSettings, folders: _Folders, tally: _Tally, ranked: _Ranking,
                  out: Path, html: HtmlExtras) -> Dict[str, object]:
    """The chart, the overlays and ``report.json`` written into ``out``, under its lock; returns
    the report."""
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
        _report_outputs(stage, ranked, tally, folders, s.on_error)
        _html_outputs(stage, set(staged), ranked, tally, folders, out, html, s.on_error)
        report = _report_dict(tally, ranked)
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
    return report


def _html_outputs(stage: Callable[[str], str], drawn: set, r: _Ranking, tally: _Tally, folders: _Folders,
                  out: Path, html: HtmlExtras, on_error: str) -> None:
    """``report.html`` and ``report_data.js`` staged, the thumbnails written (each atomically,
    named by position: a re-run writes the same files)."""
    from mars_plugin.commands.report_html import html_data, write_report_thumbnails
    from mars_plugin.commands.reproduce_report import PICTURES
    from mars_plugin.pictures.html_report import page_files

    stems = [stem for stem, _ in tally.images]

    def on_fail(stem: str, e: BaseException) -> None:  # --on-error, once a file (the overlays may have seen it)
        if stem not in {f for f, _ in tally.summary.failed}:
            _fail(stem, e, on_error, tally.summary)

    write_report_thumbnails(out, stems, folders.labels, folders.debiased, folders.images, html.gt_dir, html.io_workers,
                            on_fail)
    figures = [(alt, name) for alt, name in PICTURES if name in drawn]
    data = html_data(r.class_names, r.ranking, tally.images, SHARE_DEFINITION, figures, html)
    for name, text in page_files(data).items():
        Path(stage(name)).write_text(text, encoding="utf-8")


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


def _report_outputs(stage: Callable[[str], str], r: _Ranking, tally: _Tally, folders: _Folders,
                    on_error: str) -> None:
    """The chart and the overlays of :func:`report_job`, each written to ``stage(name)``."""
    from mars_plugin.pictures import bar_charts, label_images, panel_grids

    class_names, num_classes, share, ranking = r.class_names, r.num_classes, r.share, r.ranking
    examples, class_examples, total, summary = r.examples, r.class_examples, tally.total, tally.summary
    images_dir, labels_dir, debiased_dir = folders.images, folders.labels, folders.debiased
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
    report, s = report_job(args.labels, args.debiased, args.images, args.out, settings=ReportSettings.from_args(args))
    print("classes ranked by the share of their pseudo-label pixels marked biased (all images summed):")
    width = max((len(n) for n in report["ranking"]), default=0)
    for name in report["ranking"]:
        c = report["classes"][name]
        print(f"  {name:<{width}}  {100 * c['share_removed']:5.1f}% of {c['pixels']:,} pixels "
              f"({100 * c['pixel_share']:.1f}% of all foreground pixels)")
    print(f"report -> {args.out}; {s.line('read')}")
    return s
