"""Folder jobs behind the ``mars`` command line: centroids, debias, evaluate, report.

Each job reads the disk layout of :mod:`mars_plugin.files`, streams one image at a time, shows a
progress bar, writes every output atomically, and treats a bad input file according to
``on_error``: ``"stop"`` raises a :class:`JobError` naming the file, ``"skip"`` reports it and
goes on (the summary lists every skipped file).
"""
from __future__ import annotations

import json
import multiprocessing as mp
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from .crf import check_crf_backend, check_crf_params
from .debias import check_pseudo_label, debiased_similarity, mark_biased, refine_mask
from .files import (
    IGNORE_VALUE,
    atomic_write,
    classes_in_label,
    find_image,
    list_stems,
    read_features,
    read_image,
    read_label,
    write_label,
)
from .metrics import confusion_matrix, segmentation_scores
from .selection import DebiasedCentroids, select_centroids

__all__ = [
    "JobError",
    "JobSummary",
    "LabelFormat",
    "label_format",
    "read_image_labels",
    "centroids_job",
    "debias_job",
    "evaluate_job",
    "report_job",
]

ON_ERROR = ("stop", "skip")


class JobError(RuntimeError):
    """A file could not be processed and ``on_error="stop"``."""


@dataclass
class JobSummary:
    """What a folder job did: files written, files already there (resume), files skipped."""

    done: int = 0
    existing: int = 0
    failed: List[Tuple[str, str]] = field(default_factory=list)

    def line(self, verb: str = "written") -> str:
        s = f"{self.done} {verb}"
        if self.existing:
            s += f", {self.existing} already done"
        s += f", {len(self.failed)} failed"
        for stem, why in self.failed[:10]:
            s += f"\n  failed {stem}: {why}"
        if len(self.failed) > 10:
            s += f"\n  ... and {len(self.failed) - 10} more"
        return s


def _rank_world() -> Tuple[int, int]:
    """(rank, world size) under an initialised torch.distributed, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_on_error(on_error: str) -> None:
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")


def _progress(it, total: int, desc: str, enabled: bool):
    if not enabled:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, total=total, desc=desc, unit="img")


def read_image_labels(path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
    """Image-level labels from a JSON file ``{stem: [1-based class ids]}`` (None: no file).

    Without a file, every job derives an image's classes from its pseudo label.
    """
    if path is None:
        return None
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{p}: cannot read image labels as JSON {{stem: [class ids]}} ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{p}: image labels must be a JSON object {{stem: [class ids]}}, got {type(data).__name__}")
    out: Dict[str, List[int]] = {}
    for stem, ids in data.items():
        if not isinstance(ids, list) or not all(isinstance(i, int) and 1 <= i <= num_classes for i in ids):
            raise ValueError(f"{p}: labels of {stem!r} must be a list of class ids in 1..{num_classes}, got {ids!r}")
        out[str(stem)] = sorted(set(ids))
    return out


def _stems(labels_dir: os.PathLike, skip_suffixes: Sequence[str] = ()) -> List[str]:
    stems = [s for s in list_stems(labels_dir, (".png",)) if not any(s.endswith(x) for x in skip_suffixes)]
    if not stems:
        raise ValueError(f"{labels_dir}: no .png label files")
    return stems


WSSS_ADAPTERS = ("irnet", "advcam", "seam", "rsepm")


@dataclass
class LabelFormat:
    """How a WSSS repository stores labels: PNG mode of its outputs, sibling files to skip,
    and how its image-level label file is read (through ``mars_plugin.adapters.<name>``)."""

    name: Optional[str] = None
    mode: str = "P"
    skip_suffixes: Tuple[str, ...] = ()
    dataset: str = "voc"
    trust_pickle: bool = False

    def image_labels(self, path: Optional[os.PathLike], num_classes: int) -> Optional[Dict[str, List[int]]]:
        if path is None:
            return None
        if self.name is None:
            return read_image_labels(path, num_classes)
        import inspect

        adapter = _adapter(self.name)
        kwargs: Dict[str, Any] = {"trust_pickle": self.trust_pickle}
        if "dataset" in inspect.signature(adapter.load_image_labels).parameters:
            kwargs["dataset"] = self.dataset
        multi_hot = adapter.load_image_labels(path, **kwargs)
        return {str(k): [int(i) + 1 for i in torch.nonzero(v).flatten().tolist()] for k, v in multi_hot.items()}


def _adapter(name: str):
    import importlib

    if name not in WSSS_ADAPTERS:
        raise ValueError(f"wsss must be one of {WSSS_ADAPTERS}, got {name!r}")
    return importlib.import_module(f"mars_plugin.adapters.{name}")


def label_format(wsss: Optional[str] = None, *, dataset: str = "voc", trust_pickle: bool = False) -> LabelFormat:
    """The :class:`LabelFormat` of a WSSS repository (None: this package's own layout)."""
    if wsss is None:
        return LabelFormat(trust_pickle=trust_pickle, dataset=dataset)
    adapter = _adapter(wsss)
    skip = ("_palette",) if wsss in ("irnet", "advcam") else ()
    return LabelFormat(wsss, adapter.LABEL_MODE, skip, dataset, trust_pickle)


# --------------------------------------------------------------------------------------------
# centroids
# --------------------------------------------------------------------------------------------


def _centroid_samples(
    stems: Sequence[str], features_dir: Path, labels_dir: Path, image_labels, ignore_index: int,
    on_error: str, summary: JobSummary, progress: bool,
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    for stem in _progress(stems, len(stems), "centroids", progress):
        try:
            feat_path = features_dir / f"{stem}.npy"
            if not feat_path.is_file():
                raise ValueError(f"missing feature file {feat_path}")
            feats = read_features(feat_path)
            label = read_label(labels_dir / f"{stem}.png", biased_value=None)
            if image_labels is not None:
                if stem not in image_labels:
                    raise ValueError(f"{stem!r} has no entry in the image-labels file")
                # Pseudo-label classes the image-level labels deny are not trusted: ignore them.
                allowed = torch.tensor([0, ignore_index] + image_labels[stem])
                label = torch.where(torch.isin(label, allowed), label, torch.full_like(label, ignore_index))
        except ValueError as e:
            if on_error == "stop":
                raise JobError(f"{stem}: {e}") from e
            summary.failed.append((stem, str(e)))
            continue
        summary.done += 1
        yield feats, label


def resolve_device(device: str) -> torch.device:
    """``"auto"``: under torchrun, GPU ``LOCAL_RANK`` (mod the GPU count) when CUDA is available,
    else the CPU; anything else is passed to ``torch.device``."""
    if device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available here; use cpu or auto")
    return dev


def centroids_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    num_classes: int,
    out: os.PathLike,
    *,
    image_labels: Optional[os.PathLike] = None,
    alpha: float = 0.4,
    k_fg: int = 2,
    k_bg: int = 2,
    seed: int = 0,
    batch_size: int = 64,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
    fmt: Optional[LabelFormat] = None,
    device: str = "cpu",
    spill_dir: Optional[os.PathLike] = None,
    spill_mb: float = 1024,
    backend: str = "auto",
) -> Tuple[DebiasedCentroids, JobSummary]:
    """Stream every (features, pseudo label) pair of two folders into :func:`select_centroids`
    and save the result to ``out`` (a ``.pt`` file, written atomically). ``device`` runs the
    K-means (``"auto"``: this rank's GPU when CUDA is available, else the CPU); ``spill_dir``,
    ``spill_mb`` and ``backend`` are passed to :func:`select_centroids`.

    ``fmt`` (see :func:`label_format`) reads a WSSS repository's own folders and image-label
    file. Under torch.distributed (e.g. ``torchrun``), each rank reads its strided shard of the
    images and rank 0 writes ``out``; every rank returns the same centroids.
    """
    _check_on_error(on_error)
    fmt = fmt or LabelFormat()
    stems = _stems(labels_dir, fmt.skip_suffixes)
    labels = fmt.image_labels(image_labels, num_classes)
    rank, world = _rank_world()
    stems = stems[rank::world]
    summary = JobSummary()
    samples = _centroid_samples(stems, Path(features_dir), Path(labels_dir), labels, ignore_index, on_error, summary, progress)
    V = select_centroids(
        samples, num_classes, alpha=alpha, k_fg=k_fg, k_bg=k_bg, seed=seed, batch_size=batch_size,
        ignore_index=ignore_index, device=resolve_device(device), spill_dir=spill_dir, spill_mb=spill_mb,
        backend=backend,
    ).to("cpu")
    if rank == 0:
        V.save(out)
    return V, summary


# --------------------------------------------------------------------------------------------
# debias
# --------------------------------------------------------------------------------------------

_WORKER: Dict[str, Any] = {}


def _debias_init(config: Dict[str, Any]) -> None:
    # One thread per worker process: N workers use N cores instead of fighting over them.
    if config["workers"] > 1:
        torch.set_num_threads(1)
    _WORKER.clear()
    _WORKER.update(config)
    _WORKER["centroids"] = DebiasedCentroids.load(config["centroids_path"]).to(config["device"])


def _debias_read(stem: str) -> Dict[str, Any]:
    """One image's inputs, checked, and its soft mask M_hat (Eq. 4) on the job's device."""
    cfg = _WORKER
    V: DebiasedCentroids = cfg["centroids"]
    feat_path = Path(cfg["features_dir"]) / f"{stem}.npy"
    if not feat_path.is_file():
        raise ValueError(f"missing feature file {feat_path}")
    feats = read_features(feat_path).to(cfg["device"])
    label = read_label(Path(cfg["labels_dir"]) / f"{stem}.png", biased_value=None)
    if cfg["image_labels"] is not None:
        if stem not in cfg["image_labels"]:
            raise ValueError(f"{stem!r} has no entry in the image-labels file")
        classes = cfg["image_labels"][stem]
    else:
        classes = [c for c in classes_in_label(label, cfg["ignore_index"]) if c <= V.num_classes]
    # Eq. 5's checks before the batch's CRF, so that a bad file fails alone.
    label = check_pseudo_label(label, V, ignore_index=cfg["ignore_index"])
    item = {"stem": stem, "label": label,
            "similarity": debiased_similarity(feats, V, classes, size=tuple(label.shape))}
    if cfg["refine"] == "crf":
        image = read_image(find_image(cfg["images_dir"], stem))
        if image.shape[:2] != tuple(label.shape):
            raise ValueError(f"image {image.shape[1]}x{image.shape[0]} and pseudo label "
                             f"{label.shape[1]}x{label.shape[0]} (width x height) differ in size")
        item["image"] = torch.from_numpy(image).to(cfg["device"])
    return item


def _debias_batch(stems: Sequence[str]) -> List[Tuple[str, str, Optional[str]]]:
    """Debias a batch of images (one CRF call on the job's device); returns (stem,
    "done"|"existing"|"failed", error message) for each."""
    cfg = _WORKER
    results: List[Tuple[str, str, Optional[str]]] = []
    items = []
    for stem in stems:
        if (Path(cfg["out_dir"]) / f"{stem}.png").is_file():
            results.append((stem, "existing", None))
            continue
        try:
            items.append(_debias_read(stem))
        except ValueError as e:
            results.append((stem, "failed", str(e)))
    if not items:
        return results
    sims = [it["similarity"] for it in items]
    if cfg["refine"] == "crf":
        masks = refine_mask(sims, [it["image"] for it in items], cfg["crf_params"], cfg["crf_backend"])
    else:
        masks = [m > cfg["threshold"] for m in sims]
    for it, mask in zip(items, masks):
        y = mark_biased(it["label"], mask.cpu(), cfg["centroids"], ignore_index=cfg["ignore_index"])
        write_label(Path(cfg["out_dir"]) / f"{it['stem']}.png", y, mode=cfg["mode"])
        results.append((it["stem"], "done", None))
    return results


def debias_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    centroids: os.PathLike,
    out_dir: os.PathLike,
    *,
    images_dir: Optional[os.PathLike] = None,
    refine: str = "crf",
    threshold: float = 0.5,
    image_labels: Optional[os.PathLike] = None,
    workers: int = 1,
    batch_size: int = 8,
    device: str = "cpu",
    ignore_index: int = IGNORE_VALUE,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
    on_error: str = "stop",
    progress: bool = True,
    fmt: Optional[LabelFormat] = None,
) -> JobSummary:
    """Write one debiased label PNG per pseudo label (biased pixels as 254, see
    :data:`mars_plugin.files.BIASED_VALUE`).

    Images are debiased ``batch_size`` at a time on ``device`` (``cpu``, ``cuda``, ``cuda:N``,
    ``auto``): Eq. 4 per image, then one dense-CRF call for the batch
    (:func:`mars_plugin.debias.refine_mask`; images of any sizes), then Eq. 5. ``crf_params`` is
    a preset name or a dict (:data:`mars_plugin.crf.CRF_PRESETS`). Resumable: images whose
    output already exists are skipped (outputs are written atomically, so an existing file is
    always complete). ``workers`` > 1 runs batches in that many processes (one thread each);
    outputs do not depend on ``workers`` or ``batch_size``. Under torch.distributed each rank
    debiases its strided shard. ``fmt`` writes in a WSSS repository's PNG mode (see
    :func:`label_format`).
    """
    _check_on_error(on_error)
    if refine not in ("crf", "threshold"):
        raise ValueError(f"refine must be 'crf' or 'threshold', got {refine!r}")
    if refine == "crf" and images_dir is None:
        raise ValueError("refine='crf' needs images_dir (the RGB images); or use refine='threshold'")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    params = check_crf_params(crf_params)
    check_crf_backend(crf_backend)
    dev = resolve_device(device)
    fmt = fmt or LabelFormat()
    stems = _stems(labels_dir, fmt.skip_suffixes)
    rank, world = _rank_world()
    stems = stems[rank::world]
    V = DebiasedCentroids.load(centroids)
    os.makedirs(out_dir, exist_ok=True)
    config = dict(
        centroids_path=os.fspath(centroids), features_dir=os.fspath(features_dir), labels_dir=os.fspath(labels_dir),
        images_dir=None if images_dir is None else os.fspath(images_dir), out_dir=os.fspath(out_dir), refine=refine,
        threshold=threshold, ignore_index=ignore_index, crf_params=params, crf_backend=crf_backend,
        image_labels=fmt.image_labels(image_labels, V.num_classes), mode=fmt.mode, device=str(dev), workers=workers,
    )
    summary = JobSummary()
    batches = [stems[i:i + batch_size] for i in range(0, len(stems), batch_size)]

    def consume(results) -> None:
        for stem, status, err in _progress((r for batch in results for r in batch), len(stems), "debias", progress):
            if status == "done":
                summary.done += 1
            elif status == "existing":
                summary.existing += 1
            else:
                if on_error == "stop":
                    raise JobError(f"{stem}: {err}")
                summary.failed.append((stem, err or ""))

    if workers == 1:
        _debias_init(config)
        consume(map(_debias_batch, batches))
    else:
        # spawn, not fork: forking a process whose torch already started OpenMP threads can hang.
        ctx = mp.get_context("spawn")
        with ctx.Pool(workers, initializer=_debias_init, initargs=(config,)) as pool:
            consume(pool.imap(_debias_batch, batches))
    return summary


# --------------------------------------------------------------------------------------------
# evaluate
# --------------------------------------------------------------------------------------------


def evaluate_job(
    pred_dir: os.PathLike,
    gt_dir: os.PathLike,
    num_classes: int,
    *,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
) -> Tuple[Dict[str, object], JobSummary]:
    """SEAM-style IoU/FP/FN over every ground-truth PNG of ``gt_dir`` and its prediction.

    A prediction pixel of 254 (biased, in a debiased label) counts as background; 255 in a
    prediction counts as "no class". Returns the scores of
    :func:`mars_plugin.metrics.segmentation_scores` plus ``confusion`` and ``num_images``.
    """
    _check_on_error(on_error)
    stems = _stems(gt_dir)
    summary = JobSummary()
    cm = None
    for stem in _progress(stems, len(stems), "evaluate", progress):
        try:
            pred_path = Path(pred_dir) / f"{stem}.png"
            if not pred_path.is_file():
                raise ValueError(f"missing prediction {pred_path}")
            pred = read_label(pred_path)
            gt = read_label(Path(gt_dir) / f"{stem}.png", biased_value=None)
            if pred.shape != gt.shape:
                raise ValueError(f"prediction {tuple(pred.shape)} and ground truth {tuple(gt.shape)} differ in size")
            m = confusion_matrix(pred, gt, num_classes, ignore_index=ignore_index)
        except ValueError as e:
            if on_error == "stop":
                raise JobError(f"{stem}: {e}") from e
            summary.failed.append((stem, str(e)))
            continue
        cm = m if cm is None else cm + m
        summary.done += 1
    if cm is None:
        raise JobError("no image could be evaluated")
    scores = segmentation_scores(cm)
    scores["confusion"] = cm.tolist()
    scores["num_images"] = summary.done
    return scores, summary


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


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
    * ``per_class.png``: for each class in ranking order, its ``per_class`` images with the
      largest share of that class's pixels removed (ties: more removed pixels first), only
      images where some were removed (none when 0).

    Both overlay grids carry a colour legend (class name -> colour, removed, ignore).
    """
    from . import plots

    _check_on_error(on_error)
    for value, name in ((num_examples, "num_examples"), (per_class, "per_class")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    stems = _stems(debiased_dir)
    summary = JobSummary()
    total: Dict[int, int] = {}
    removed: Dict[int, int] = {}
    per_image: List[Tuple[float, str]] = []
    per_class_images: Dict[int, List[Tuple[float, int, int, str]]] = {}  # c -> (share, removed, pixels, stem)
    for stem in _progress(stems, len(stems), "report", progress):
        try:
            y = read_label(Path(labels_dir) / f"{stem}.png", biased_value=None)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            if y.shape != d.shape:
                raise ValueError(f"pseudo label {tuple(y.shape)} and debiased label {tuple(d.shape)} differ in size")
        except ValueError as e:
            if on_error == "stop":
                raise JobError(f"{stem}: {e}") from e
            summary.failed.append((stem, str(e)))
            continue
        fg = (y > 0) & (y != ignore_index)
        gone = fg & (d == -1)
        for c in torch.unique(y[fg]).tolist():
            t_c, r_c = int((y == c).sum()), int((gone & (y == c)).sum())
            total[c] = total.get(c, 0) + t_c
            removed[c] = removed.get(c, 0) + r_c
            if r_c:
                per_class_images.setdefault(c, []).append((r_c / t_c, r_c, t_c, stem))
        if int(fg.sum()):
            per_image.append((int(gone.sum()) / int(fg.sum()), stem))
        summary.done += 1
    if not total:
        raise JobError("no foreground pixel in any pseudo label: nothing to report")
    num_classes = max(total)
    if class_names is None:
        class_names = ["background"] + [f"class {c}" for c in range(1, num_classes + 1)]
    if len(class_names) < num_classes + 1:
        raise ValueError(f"class_names has {len(class_names)} names but labels reach class {num_classes}")
    share = [float("nan")] + [removed.get(c, 0) / total[c] if c in total else float("nan") for c in range(1, num_classes + 1)]
    ranking = sorted((c for c in range(1, num_classes + 1) if c in total), key=lambda c: -share[c])
    per_image.sort(key=lambda t: (-t[0], t[1]))
    examples = per_image[:num_examples]
    class_examples = {c: sorted(per_class_images.get(c, []), key=lambda t: (-t[0], -t[1], t[3]))[:per_class]
                      for c in ranking}
    all_fg = sum(total.values())

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots.save_iou_bar_chart(
        out / "biased_share.png", list(class_names[1 : num_classes + 1]),
        {"pixels marked biased (% of the class's pseudo-label pixels)": [100 * s for s in share[1:]]},
        title=f"Which classes were biased (MARS), {summary.done} images", ylabel="marked biased (%)",
        order=[c - 1 for c in ranking],
        note=f"Share = {SHARE_DEFINITION}. Under each name: its pseudo-label pixels (a small class can rank "
             f"high on few pixels).",
        tick_notes=[_px(total.get(c, 0)) for c in range(1, num_classes + 1)],
    )
    panels: Dict[str, Tuple[List[Tuple[str, Any]], set]] = {}  # stem -> (panels, classes in its pseudo label)

    def overlay(stem: str, caption: str):
        if stem not in panels:
            img = read_image(find_image(images_dir, stem))
            y = read_label(Path(labels_dir) / f"{stem}.png", biased_value=None)
            d = read_label(Path(debiased_dir) / f"{stem}.png")
            panels[stem] = ([
                ("image", img), ("pseudo label", plots.blend(img, y)),
                ("removed pixels", plots.removed_mask_image(img, y, d)), ("debiased label", plots.blend(img, d)),
            ], {c for c in torch.unique(y).tolist() if 0 < c <= num_classes})
        return caption, panels[stem][0]

    def save_grid(name: str, rows: List[Tuple[str, Any]], stems: List[str]) -> None:
        if rows:  # legend: background, the classes drawn, removed, ignore
            shown = sorted(set().union(*(panels[s][1] for s in stems)))
            plots.save_overlay_grid(out / name, rows, legend=plots.class_legend(list(class_names), [0] + shown))

    save_grid("most_changed.png", [overlay(stem, f"{stem}: {100 * frac:.0f}% of its foreground pixels removed")
                                   for frac, stem in examples], [s for _, s in examples])
    chosen = [(c, f, r, t, stem) for c in ranking for f, r, t, stem in class_examples[c]]
    save_grid("per_class.png", [overlay(stem, f"{class_names[c]}: {stem}: {100 * f:.0f}% of its {class_names[c]} "
                                              f"pixels removed ({r} of {t})") for c, f, r, t, stem in chosen],
              [row[-1] for row in chosen])
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
    atomic_write(out / "report.json", lambda tmp: Path(tmp).write_text(json.dumps(report, indent=2)))
    return report, summary
