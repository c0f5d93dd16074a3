"""``mars centroids``: stream (features, pseudo label) pairs of two folders into
:func:`~mars_plugin.method.selection.select_centroids` (Eq. 1-3) and save the debiased centroids.

Under torch.distributed (``torchrun``) each rank reads its strided shard of the images;
:mod:`mars_plugin.runs.distributed` lets the ranks meet and learn that one of them failed
(no-ops in one process). Errors and summaries: :mod:`mars_plugin.runs.errors`.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from mars_plugin.formats.files import FEATURE_EXTENSIONS, find_features, read_features, read_label
from mars_plugin.runs.distributed import _dist_ready, _free, _rank_world, resolve_device, share_error, sync_group
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, _fail, one_line
from mars_plugin.method.selection import DebiasedCentroids, select_centroids
from mars_plugin.commands.centroids_settings import CentroidsSettings
from mars_plugin.commands.label_formats import LabelFormat, _class_label, _class_names, _wsss_class_names, label_format
from mars_plugin.commands.inputs import (
    _check_out_file,
    check_out_apart,
    _common_dim,
    _only,
    _progress,
    _stems,
    check_any_valid,
    check_features,
    check_input_folder,
    check_label_values,
    load_centroids,
    no_valid_pixel,
)

__all__ = ["centroids_job", "CentroidsSettings", "run_centroids_command"]


def _centroid_samples(
    stems: Sequence[str], features_dir: Path, labels_dir: Path, image_labels, num_classes: int,
    ignore_index: int, on_error: str, summary: JobSummary, progress: bool, yielded: List[str],
) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """Checked (features, label) pairs; every check that :func:`select_centroids` would make
    on a sample is made here first, so that a bad file is named and ``on_error`` applies.
    ``yielded`` receives the stem of each pair, in order."""
    ref = _common_dim(features_dir, stems)
    dim, dim_from = ref if ref is not None else (None, "")
    for stem in _progress(stems, len(stems), "centroids", progress):
        try:
            feat_path = find_features(features_dir, stem)
            feats = read_features(feat_path)
            check_features(feats, feat_path, dim, dim_from)
            label_path = labels_dir / f"{stem}.png"
            label = read_label(label_path, biased_value=None)
            check_label_values(label, label_path, num_classes, ignore_index)
            empty = no_valid_pixel(label, label_path, ignore_index)
            if image_labels is not None:
                if stem not in image_labels:
                    raise ValueError(f"{stem!r} has no entry in the --image-labels file")
                # Pseudo-label classes the image-level labels deny are not trusted: ignore them.
                allowed = torch.tensor([0, ignore_index] + image_labels[stem])
                label = torch.where(torch.isin(label, allowed), label, torch.full_like(label, ignore_index))
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        summary.done += 1
        if empty is not None:
            summary.warnings.append((stem, empty))
        yielded.append(stem)
        yield feats, label


def _translate_samples_error(e: Exception, yielded: Sequence[str], summary: JobSummary) -> JobError:
    """A :func:`select_centroids` error names ``samples[i]``: name the file instead (the checks
    of :func:`_centroid_samples` should leave none but this is the safety net)."""
    msg = one_line(e)
    m = re.match(r"samples\[(\d+)\]:?\s*", msg)
    if m and int(m.group(1)) < len(yielded):
        return JobError(f"{yielded[int(m.group(1))]}: {msg[m.end():]}")
    if msg.startswith("samples is empty"):
        why = f" ({len(summary.failed)} skipped)" if summary.failed else ""
        return JobError(f"no image of --features/--labels could be used{why}")
    if msg.startswith("samples: "):
        return JobError(msg[len("samples: "):].replace("pseudo_label", "pseudo label"))
    return JobError(msg)


def centroids_job(
    features_dir: os.PathLike,
    labels_dir: os.PathLike,
    num_classes: int,
    out: os.PathLike,
    *,
    image_labels: Optional[os.PathLike] = None,
    settings: Optional[CentroidsSettings] = None,
    fmt: Optional[LabelFormat] = None,
    stems: Optional[Sequence[str]] = None,
    **keywords: Any,
) -> Tuple[DebiasedCentroids, JobSummary]:
    """Stream every (features, pseudo label) pair of two folders into :func:`select_centroids`
    and save the result to ``out`` (a ``.pt`` file, written atomically). ``settings``: a
    :class:`~mars_plugin.commands.centroids_settings.CentroidsSettings` (its ``num_classes`` is
    ``num_classes``), or its fields as ``keywords`` (``alpha``, ``k_fg``, ``k_bg``, ``seed``,
    ``batch_size``, ``ignore_index``, ``on_error``, ``progress``, ``device``, ``spill_dir``,
    ``spill_mb``, ``backend``). ``device`` runs the K-means (``"auto"``: this rank's GPU when
    CUDA is available, else the CPU); ``spill_dir``, ``spill_mb`` and ``backend`` are passed to
    :func:`select_centroids`.

    ``fmt`` (see :func:`label_format`) reads a WSSS repository's own folders and image-label
    file. Under torch.distributed (e.g. ``torchrun``), each rank reads its strided shard of the
    images and rank 0 writes ``out``; every rank returns the same centroids. ``stems``: only
    these of the folder's labels (e.g. ``mars reproduce``'s ids whose tags could be read).

    Resume (:mod:`mars_plugin.runs.run_record`): ``out`` holds the record of what made it (a
    ``"run"`` entry: the settings, and a digest of the ids, of every feature file and pseudo
    label (name, size, mtime) and of the tags). When ``out`` exists, was made with the same
    settings from the same inputs, it is kept (``existing`` in the summary: its image count); a
    change of any input computes it again; other settings (``alpha``, ``k_fg``, ``k_bg``,
    ``seed``, the folders, C...) are refused. ``device``, ``backend``, ``batch_size`` and the
    spill options are not recorded (they change the result by float rounding at most). One run
    at a time per ``out`` (a lock, ``.<name>.lock`` beside it).
    """
    check_out_apart(out, "--out", {"--features": features_dir, "--labels": labels_dir, "--image-labels": image_labels})
    s = _settings(settings, num_classes, keywords)
    _check_out_file(out, "--out")
    fmt = fmt or LabelFormat()
    stems = _only(_stems(labels_dir, fmt.skip_suffixes), stems)
    check_input_folder(features_dir, "--features", stems, FEATURE_EXTENSIONS, "feature")
    check_any_valid(labels_dir, stems, "--labels", s.ignore_index)
    labels = fmt.image_labels(image_labels, s.num_classes)
    from mars_plugin.runs.run_record import CentroidsRecord

    record = CentroidsRecord(out, s.identity(fmt.name))
    kept = _kept(record, stems, features_dir, labels_dir, labels, s.on_error)
    try:
        if kept is not None:  # made from these inputs with these settings: keep it
            V = load_centroids(out, "--out")
            failed = [tuple(f) for f in kept] if _rank_world()[0] == 0 else []  # rank 0's record lists them all
            return V, JobSummary(existing=V.num_images, failed=failed)
        V, summary = _select(s, stems, Path(features_dir), Path(labels_dir), labels)
        _save(record, V, summary)
        return V, summary
    finally:
        record.close()


def _settings(settings: Optional[CentroidsSettings], num_classes: int, keywords: Dict[str, Any]) -> CentroidsSettings:
    """:func:`centroids_job`'s record: ``settings``, or made (and checked) from ``keywords``."""
    from mars_plugin.commands.job_settings import own_record

    if own_record("centroids_job", CentroidsSettings, settings) is None:
        return CentroidsSettings(num_classes=num_classes, **keywords)
    if keywords:
        raise ValueError("give settings=CentroidsSettings(...) or its fields as keywords, not both "
                         f"(got {sorted(keywords)})")
    if num_classes != settings.num_classes:
        raise ValueError(f"num_classes is {num_classes!r} and settings.num_classes {settings.num_classes}: "
                         "expected one class count")
    return settings


def _kept(record: Any, stems: Sequence[str], features_dir: os.PathLike, labels_dir: os.PathLike, labels: Any,
          on_error: str) -> Optional[List[Any]]:
    """Rank 0 opens ``out``'s record (the lock, the inputs' identities, other settings refused):
    the skipped files recorded when ``out`` is current (keep it), else None, on every rank."""
    from mars_plugin.runs.run_record import broadcast_object

    error, kept = None, None
    group = sync_group()  # the ranks meet here however late rank 0 comes (24 h, not torchrun's 30 min)
    if _rank_world()[0] == 0:
        try:
            kept = record.open(stems, features_dir, labels_dir, labels, on_error)
        except Exception as e:  # noqa: BLE001 -- raised on every rank just below
            error = e
    try:
        share_error(error, group)  # a refusal on rank 0 (another run, other settings) stops every rank
        return broadcast_object(kept, group)
    finally:
        _free(group)


def _select(s: CentroidsSettings, stems: Sequence[str], features_dir: Path, labels_dir: Path,
            labels: Any) -> Tuple[DebiasedCentroids, JobSummary]:
    """Eq. 1-3 over this rank's strided shard of ``stems``: the centroids (on the CPU) and the
    shard's summary; an error of :func:`select_centroids` names the file, not ``samples[i]``."""
    rank, world = _rank_world()
    summary = JobSummary()
    yielded: List[str] = []
    samples = _centroid_samples(stems[rank::world], features_dir, labels_dir, labels, s.num_classes, s.ignore_index,
                                s.on_error, summary, s.progress, yielded)
    dev = resolve_device(s.device)
    try:
        V = select_centroids(
            samples, s.num_classes, alpha=s.alpha, k_fg=s.k_fg, k_bg=s.k_bg, seed=s.seed, batch_size=s.batch_size,
            ignore_index=s.ignore_index, device=dev, spill_dir=s.spill_dir, spill_mb=s.spill_mb,
            backend=s.backend,
        ).to("cpu")
    except (ValueError, TypeError) as e:
        if "samples" not in str(e):
            raise
        raise _translate_samples_error(e, yielded, summary) from None
    return V, summary


def _save(record: Any, V: DebiasedCentroids, summary: JobSummary) -> None:
    """Rank 0 saves ``V`` with its record, which lists every rank's skipped files."""
    failed = [list(f) for f in summary.failed]
    if _dist_ready():
        import torch.distributed as dist

        got: List[Any] = [None] * _rank_world()[1]
        dist.all_gather_object(got, failed)
        failed = [f for g in got for f in g]
    if _rank_world()[0] == 0:
        record.save(V, failed)


def run_centroids_command(args: argparse.Namespace) -> JobSummary:
    """``mars centroids``: :func:`centroids_job` on the parsed flags, then its summary on stdout
    (what the numbers mean, then per class: candidate centroids kept of those found, and the cut
    distance)."""
    fmt = label_format(args.wsss, dataset=args.dataset, trust_pickle=args.trust_pickle)
    # read before the work: a bad file fails fast
    names = _class_names(args.class_names) or _wsss_class_names(args)
    settings = CentroidsSettings.from_args(args)
    V, s = centroids_job(args.features, args.labels, settings.num_classes, args.out, image_labels=args.image_labels,
                         settings=settings, fmt=fmt)
    if s.existing and not s.done:  # resume: the record in --out says nothing changed
        print(f"centroids of {V.num_images} images -> {args.out}: kept, made from the same inputs with "
              "the same settings")
    else:
        print(f"centroids of {V.num_images} images -> {args.out}; {s.line('read')}")
    _print_classes(V, settings, names)
    return s


def _print_classes(V: DebiasedCentroids, settings: CentroidsSettings, names: Optional[Sequence[str]]) -> None:
    """What the two numbers and the cut distance are, then each class's."""
    alpha, k_fg = V.config.get("alpha", settings.alpha), V.config.get("k_fg", settings.k_fg)
    # What the two numbers and the distance are (selection.py, Eq. 1-2), once, before the classes.
    print(f"per class: K of N candidate centroids kept (N: K-means centroids of the class, up to {k_fg} per "
          f"image that has it; K = ceil(alpha {alpha:g} x N), those farthest from the training set's "
          "background, Eq. 1, are averaged into its debiased centroid, Eq. 2); cut distance: the Eq. 1 "
          "distance (0..1) of the last one kept")
    for c in range(1, V.num_classes + 1):
        if bool(V.valid[c]):
            print(f"  {_class_label(names, c)}: {int(V.num_selected[c])} of {int(V.num_candidates[c])} "
                  f"candidate centroids kept, cut distance {float(V.cut_distance[c]):.4f}")
        else:
            print(f"  {_class_label(names, c)}: never seen, no centroid")
