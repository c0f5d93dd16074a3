"""``mars evaluate``: SEAM-style IoU/FP/FN of a folder of predictions against the ground truth."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from mars_plugin.commands.command_table import CommandResult
from mars_plugin._checks import check_ignore_byte, check_num_classes
from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, atomic_write, read_label, stem_path
from mars_plugin.runs.errors import FILE_ERRORS, JobError, JobSummary, _check_on_error, _fail
from mars_plugin.commands.metrics import confusion_matrix, segmentation_scores
from mars_plugin.commands.label_formats import evaluate_names
from mars_plugin.commands.inputs import _progress, _stems, check_input_folder, check_label_values, no_valid_pixel

__all__ = ["evaluate_job", "run_evaluate_command", "write_scores_json"]


def evaluate_job(
    pred_dir: os.PathLike,
    gt_dir: os.PathLike,
    num_classes: int,
    *,
    ignore_index: int = IGNORE_VALUE,
    on_error: str = "stop",
    progress: bool = True,
    stems: Optional[Sequence[str]] = None,
) -> Tuple[Dict[str, object], JobSummary]:
    """SEAM-style IoU/FP/FN over every ground-truth PNG of ``gt_dir`` and its prediction
    (or over ``stems`` only: e.g. the images that have a pseudo label, when ``gt_dir`` holds
    the masks of the whole split).

    A prediction pixel of 254 (biased, in a debiased label) counts as background;
    ``ignore_index`` in a prediction counts as "no class". Any other value above C, in a
    prediction or the ground truth, is a bad file (named, ``on_error`` applies). Returns the scores of
    :func:`mars_plugin.commands.metrics.segmentation_scores` plus ``confusion`` and ``num_images``.
    """
    _check_on_error(on_error)
    num_classes = check_num_classes(num_classes)
    ignore_index = check_ignore_byte(ignore_index, num_classes=num_classes)
    if stems is None:
        stems = _stems(gt_dir, flag="--gt")
    else:
        stems = [stem_path(gt_dir, s, ".png").stem for s in stems]  # refuses unsafe ids
        if not stems:
            raise ValueError("stems is empty: nothing to evaluate")
        check_input_folder(gt_dir, "--gt", stems, (".png",), "ground-truth", of="images")
    check_input_folder(pred_dir, "--pred", stems, (".png",), "prediction", of="ground-truth masks")
    summary = JobSummary()
    cm = None
    for stem in _progress(stems, len(stems), "evaluate", progress):
        try:
            pred_path = Path(pred_dir) / f"{stem}.png"
            if not pred_path.is_file():
                raise ValueError(f"missing prediction {pred_path}")
            pred = read_label(pred_path, biased_value=None)
            # 254 in a prediction is a biased pixel of a debiased label: background (see above).
            check_label_values(pred.masked_fill(pred == BIASED_VALUE, 0), pred_path, num_classes, ignore_index)
            pred = pred.masked_fill(pred == BIASED_VALUE, -1)
            gt_path = Path(gt_dir) / f"{stem}.png"
            gt = read_label(gt_path, biased_value=None)
            check_label_values(gt, gt_path, num_classes, ignore_index)
            empty = no_valid_pixel(gt, gt_path, ignore_index)
            if pred.shape != gt.shape:
                raise ValueError(f"prediction {pred_path} {tuple(pred.shape)} and ground truth {tuple(gt.shape)} "
                                 "differ in size")
            m = confusion_matrix(pred, gt, num_classes, ignore_index=ignore_index)
        except FILE_ERRORS as e:
            _fail(stem, e, on_error, summary)
            continue
        cm = m if cm is None else cm + m
        summary.done += 1
        if empty is not None:
            summary.warnings.append((stem, empty))
    if cm is None:
        raise JobError("no image could be evaluated")
    if len(summary.warnings) == summary.done:
        raise JobError(f"--gt {gt_dir}: no ground-truth mask has a valid pixel (every pixel of all {summary.done} "
                       f"evaluated is --ignore-index {ignore_index}): nothing to score; is it the right folder?")
    scores = segmentation_scores(cm)
    scores["confusion"] = cm.tolist()
    scores["num_images"] = summary.done
    return scores, summary


def run_evaluate_command(args: argparse.Namespace) -> CommandResult:
    """``mars evaluate``: :func:`evaluate_job` on the parsed flags, its table on stdout; returns
    the summary and, with ``--json``, the write of the scores with ``class_names``
    (:func:`write_scores_json`) as the work to do once the caller holds the summary (whose
    skipped files a failed write still lists)."""
    from mars_plugin.commands.metrics import format_scores_table

    progress = not args.no_progress
    names, source = evaluate_names(args)
    scores, s = evaluate_job(args.pred, args.gt, args.num_classes, ignore_index=args.ignore_index,
                             on_error=args.on_error, progress=progress)
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
