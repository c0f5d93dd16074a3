"""``report.html`` of ``mars report``, ``mars demo`` and ``mars reproduce``: the data the page shows,
gathered from what the report counted, and its thumbnails written by the I/O workers
(:class:`~mars_plugin.runs.io_pipeline.IOPipeline`). The page itself is
:mod:`mars_plugin.pictures.html_report`, the thumbnails :mod:`mars_plugin.pictures.report_thumbnails`.

Per class: images, pixels labelled, the share marked biased, IoU/FP/FN against the ground truth
where the caller scored it (``scores``: :func:`~mars_plugin.commands.metrics.segmentation_scores`
of the debiased and the pseudo labels), the paper's per-class figures where the classes are VOC's
or COCO's, and the centroid ranking of Eq. 1-3 when a centroids file is given (its stored
per-candidate distances; a file written before they were stored shows the counts and the cut).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["HtmlExtras", "html_data", "write_report_thumbnails"]

#: Candidates drawn per class at most (the page samples its bars from them): a COCO class has
#: tens of thousands, and the page stays small.
MAX_DISTANCES = 240


@dataclass(frozen=True)
class HtmlExtras:
    """What ``report.html`` shows beyond ``mars report``'s counts, each optional:
    ``gt_dir`` (ground-truth PNGs: a panel per image), ``scores`` (``{"debiased": ..., "pseudo": ...}``,
    each ``segmentation_scores``' ``iou``/``fp``/``fn`` per class), ``centroids`` (a
    :class:`~mars_plugin.method.selection.DebiasedCentroids` or the path of its file), ``title``,
    ``io_workers`` (threads writing thumbnails; 0: this thread)."""

    gt_dir: Optional[os.PathLike] = None
    scores: Optional[Mapping[str, Mapping[str, Any]]] = None
    centroids: Any = None
    title: str = "MARS report: what was marked biased"
    io_workers: int = 0


def _centroid_ranking(V: Any, c: int) -> Optional[Dict[str, Any]]:
    """Class ``c``'s Eq. 1-3 decision: its candidates' distances (farthest first, at most
    :data:`MAX_DISTANCES`, evenly sampled), how many were kept, the cut."""
    if V is None or c > V.num_classes or not bool(V.valid[c]):
        return None
    d = V.class_distances(c)
    dist: List[float] = []
    if d is not None and d.numel():
        step = max(1, -(-d.numel() // MAX_DISTANCES))
        dist = [round(float(x), 5) for x in d[::step]]
    n, k = int(V.num_candidates[c]), int(V.num_selected[c])
    # kept is in the sampled list's units, so the bars the page colours are the kept ones
    kept_drawn = -(-k // max(1, -(-n // MAX_DISTANCES))) if dist else 0
    return {"candidates": n, "kept": k, "kept_drawn": kept_drawn, "cut": float(V.cut_distance[c]), "distances": dist}


def _load_centroids(centroids: Any) -> Any:
    if centroids is None or hasattr(centroids, "num_candidates"):
        return centroids
    from mars_plugin.commands.inputs import load_centroids

    return load_centroids(centroids, "centroids")


def _score(scores: Optional[Mapping[str, Any]], key: str, what: str, c: int) -> Optional[float]:
    s = (scores or {}).get(key)
    return None if s is None or c >= len(s[what]) else s[what][c]


def html_data(class_names: Sequence[str], ranking: Sequence[int], per_image: Sequence[Tuple[str, Mapping[int, Tuple[int, int]]]],
              share_definition: str, figures: Sequence[Tuple[str, str]], extras: HtmlExtras) -> Dict[str, Any]:
    """The page's data (:func:`mars_plugin.pictures.html_report.write_html_page`): classes in
    ``ranking`` order (most marked biased first), every image's per-class (pixels, removed)."""
    from mars_plugin.commands.reproduce_report import paper_columns

    V, paper = _load_centroids(extras.centroids), paper_columns(list(class_names))
    images: Dict[int, int] = {}
    pixels: Dict[int, int] = {}
    removed: Dict[int, int] = {}
    for _, counts in per_image:
        for c, (t, r) in counts.items():
            images[c] = images.get(c, 0) + 1
            pixels[c] = pixels.get(c, 0) + t
            removed[c] = removed.get(c, 0) + r
    classes = []
    for c in ranking:
        row = {"id": c, "name": class_names[c], "images": images.get(c, 0), "pixels": pixels.get(c, 0),
               "removed": removed.get(c, 0), "share": removed.get(c, 0) / pixels[c] if pixels.get(c) else None,
               "iou": _score(extras.scores, "debiased", "iou", c), "fp": _score(extras.scores, "debiased", "fp", c),
               "fn": _score(extras.scores, "debiased", "fn", c), "iou_pseudo": _score(extras.scores, "pseudo", "iou", c),
               "paper_rs": paper["rows"]["RS+EPM"][c] if paper else None,
               "paper_mars": paper["rows"]["MARS"][c] if paper else None,
               "centroids": _centroid_ranking(V, c)}
        classes.append(row)
    return {"title": extras.title, "num_images": len(per_image), "has_gt": extras.gt_dir is not None,
            "share_definition": share_definition, "paper": paper["table"] if paper else None,
            "classes": classes, "figures": [list(f) for f in figures],
            "images": [[stem, [[c, t, r] for c, (t, r) in sorted(counts.items())]] for stem, counts in per_image]}


def write_report_thumbnails(out: Path, stems: Sequence[str], labels_dir: Path, debiased_dir: Path, images_dir: Path,
                            gt_dir: Optional[os.PathLike], io_workers: int = 0,
                            on_fail: Optional[Callable[[str, BaseException], Any]] = None) -> int:
    """Every image's thumbnails (:func:`~mars_plugin.pictures.report_thumbnails.write_thumbnails`),
    the i-th stem as index i, read and written by ``io_workers`` threads; returns the bytes written.
    The caller passes the stems its count read; an image whose pixels cannot be decoded (a
    truncated file passes the count's header probe) goes to ``on_fail(stem, error)`` (default:
    raised) and gets no thumbnails."""
    from mars_plugin.formats.files import find_image, read_image, read_label
    from mars_plugin.pictures.report_thumbnails import write_thumbnails
    from mars_plugin.runs.errors import FILE_ERRORS
    from mars_plugin.runs.io_pipeline import IOPipeline

    def read(item: Tuple[int, str]) -> Tuple[int, Any, Dict[str, Any], Any]:
        i, stem = item
        labels = {"pseudo": read_label(labels_dir / f"{stem}.png", biased_value=None),
                  "debiased": read_label(debiased_dir / f"{stem}.png")}
        gt_path = None if gt_dir is None else Path(gt_dir) / f"{stem}.png"
        # an image without ground truth (not every tree has a mask for each) has no gt panel
        gt = read_label(gt_path, biased_value=None) if gt_path is not None and gt_path.is_file() else None
        return i, read_image(find_image(images_dir, stem)), labels, gt

    total = 0
    with IOPipeline(io_workers, ahead=4 * max(1, io_workers), behind=4 * max(1, io_workers)) as io:
        for (i, stem), got in io.reads(read, list(enumerate(stems))):
            try:
                _, image, labels, gt = got.result()
            except FILE_ERRORS as e:
                if on_fail is None:
                    raise
                on_fail(stem, e)
                continue
            io.write(i, write_thumbnails, out, i, image, labels, gt)
            total += sum(n for _, n in io.written())
        total += sum(n for _, n in io.written(0))
    return total
