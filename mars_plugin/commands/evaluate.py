"""``mars evaluate``: SEAM-style IoU/FP/FN of a folder of predictions against the ground truth."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from mars_plugin.commands.command_table import CommandResult
from mars_plugin.commands.evaluate_settings import EvaluateSettings
from mars_plugin.formats.files import BIASED_VALUE, atomic_write, read_label, stem_path
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, _fail
from mars_plugin.commands.metrics import confusion_matrix, segmentation_scores
from mars_plugin.commands.label_formats import evaluate_names
from mars_plugin.commands.inputs import _progress, _stems, check_input_folder, check_label_values, no_valid_pixel

__all__ = ["evaluate_job", "run_evaluate_command", "write_scores_json"]


def evaluate_job(
    pred_dir: os.PathLike,
    gt_dir: os.PathLike,
    num_classes: Optional[int] = None,
    *,
    settings: Optional[EvaluateSettings] = None,
    stems: Optional[Sequence[str]] = None,
    **keywords: Any,
) -> Tuple[Dict[str, object], JobSummary]:
    """SEAM-style IoU/FP/FN over every ground-truth PNG of ``gt_dir`` and its prediction
    (or over ``stems`` only: e.g. the images that have a pseudo label, when ``gt_dir`` holds
    the masks of the whole split).

    ``settings``: an :class:`~mars_plugin.commands.evaluate_settings.EvaluateSettings`, or its
    fields as ``num_classes`` and ``keywords`` (``ignore_index``, ``on_error``, ``progress``).

    A prediction pixel of 254 (biased, in a debiased label) counts as background;
    ``ignore_index`` in a prediction counts as "no class". Any other value above C, in a
    prediction or the ground truth, is a bad file (named, ``on_error`` applies). Returns the scores of
    :func:`mars_plugin.commands.metrics.segmentation_scores` plus ``confusion`` and ``num_images``.
    """
    from mars_plugin.commands.job_settings import own_record

    own_record("evaluate_job", EvaluateSettings, settings)
    if settings is not None and (keywords or num_classes is not None):
        raise ValueError(f"give settings=EvaluateSettings(...) or its fields as keywords, not both "
                         f"(got {sorted(keywords) + (['num_classes'] if num_classes is not None else [])})")
    s = settings if settings is not None else EvaluateSettings(num_classes, **keywords)
    stems = _evaluated_stems(pred_dir, gt_dir, stems)
    summary = JobSummary()
    cm = None
    for stem in _progress(stems, len(stems), "evaluate", s.progress):
        try:
            m, empty = _image_confusion(s, Path(pred_dir) / f"{stem}.png", Path(gt_dir) / f"{stem}.png")
        except FILE_ERRORS as e:
            _fail(stem, e, s.on_error, summary)
            continue
        cm = m if cm is None else cm + m
        summary.done += 1
        if empty is not None:
            summary.warnings.append((stem, empty))
    if cm is None:
        raise JobError("no image could be evaluated")
    if len(summary.warnings) == summary.done:
        raise JobError(f"--gt {gt_dir}: no ground-truth mask has a valid pixel (every pixel of all {summary.done} "
                       f"evaluated is --ignore-index {s.ignore_index}): nothing to score; is it the right folder?")
    scores = segmentation_scores(cm)
    scores["confusion"] = cm.tolist()
    scores["num_images"] = summary.done
    return scores, summary


def _evaluated_stems(pred_dir: os.PathLike, gt_dir: os.PathLike, stems: Optional[Sequence[str]]) -> List[str]:
    """The images scored (every mask of ``gt_dir``, or ``stems``), once both folders are
    checked: a mistyped folder is one line, not one failure per image."""
    if stems is None:
        stems = _stems(gt_dir, flag="--gt")
    else:
        stems = [stem_path(gt_dir, s, ".png").stem for s in stems]  # refuses unsafe ids
        if not stems:
            raise ValueError("stems is empty: nothing to evaluate")
        check_input_folder(gt_dir, "--gt", stems, (".png",), "ground-truth", of="images")
    check_input_folder(pred_dir, "--pred", stems, (".png",), "prediction", of="ground-truth masks")
    return stems


def _image_confusion(s: EvaluateSettings, pred_path: Path, gt_path: Path) -> Tuple[np.ndarray, Optional[str]]:
    """One image's confusion matrix, and its warning when its mask has no valid pixel (None:
    it has); a bad file raises (a :data:`FILE_ERRORS`)."""
    if not pred_path.is_file():
        raise ValueError(f"missing prediction {pred_path}")
    pred = read_label(pred_path, biased_value=None)
    # 254 in a prediction is a biased pixel of a debiased label: background (see evaluate_job).
    check_label_values(pred.masked_fill(pred == BIASED_VALUE, 0), pred_path, s.num_classes, s.ignore_index)
    pred = pred.masked_fill(pred == BIASED_VALUE, -1)
    gt = read_label(gt_path, biased_value=None)
    check_label_values(gt, gt_path, s.num_classes, s.ignore_index)
    empty = no_valid_pixel(gt, gt_path, s.ignore_index)
    if pred.shape != gt.shape:
        raise ValueError(f"prediction {pred_path} {tuple(pred.shape)} and ground truth {tuple(gt.shape)} "
                         "differ in size")
    return confusion_matrix(pred, gt, s.num_classes, ignore_index=s.ignore_index), empty


def run_evaluate_command(args: argparse.Namespace) -> CommandResult:
    """``mars evaluate``: :func:`evaluate_job` on the parsed flags, its table on stdout; returns
    the summary and, with ``--json``, the write of the scores with ``class_names``
    (:func:`write_scores_json`) as the work to do once the caller holds the summary (whose
    skipped files a failed write still lists)."""
    from mars_plugin.commands.metrics import format_scores_table

    names, source = evaluate_names(args)
    scores, s = evaluate_job(args.pred, args.gt, settings=EvaluateSettings.from_args(args))
    print(format_scores_table(names[: args.num_classes + 1], {"": scores}))
    if source is not None:
        print(f"class names from {source}")
    print(f"{s.line('evaluated')}")
    scores = dict(scores, class_names=names[: args.num_classes + 1])
    return CommandResult(summary=s, after=(lambda: write_scores_json(args.json, scores)) if args.json else None)


def write_scores_json(path: os.PathLike, scores: Dict[str, object]) -> None:
    """``--json``: the scores, written atomically; a failure is a :class:`JobError` naming the flag."""
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(scores, indent=2)))
    except OSError as e:
        raise JobError(f"--json {path}: cannot write it ({e.strerror or e})") from None
