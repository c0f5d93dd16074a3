"""Segmentation metrics with SEAM's formulas: per-class IoU, FP and FN from one confusion matrix.

Counts are accumulated over the whole set on pixels where the ground truth is not ignored; then
for class c with T = ground-truth pixels, P = predicted pixels, TP = both:

    IoU = TP / (T + P - TP),   FP = (P - TP) / (T + P - TP),   FN = (T - TP) / (T + P - TP)

(so IoU + FP + FN = 1), and mIoU is the mean IoU over the classes present (T + P > 0).
"""
from __future__ import annotations

import math
from typing import Dict, List, Sequence

import numpy as np
import torch

from mars_plugin._checks import MAX_NUM_CLASSES, RESERVED_REASON, as_tensor, check_num_classes, describe

__all__ = ["confusion_matrix", "segmentation_scores", "format_scores_table"]


def confusion_matrix(pred, gt, num_classes: int, *, ignore_index: int = 255) -> np.ndarray:
    """(C+1, C+2) int64 counts, rows = ground truth 0..C, columns = prediction 0..C + "no class".

    Shapes:
        pred, gt: (H, W) or (B, H, W) integer maps. ``num_classes`` is C (foreground classes), 1..253:
            254 and 255 are the biased and ignore bytes, never classes.

    Pixels whose ground truth is ``ignore_index`` are skipped. A prediction of -1 (a biased
    pixel of a debiased label) counts as background; any other prediction outside 0..C
    (e.g. an ignore value in a pseudo label) counts as "no class": it adds to T of the pixel's
    true class but to no P.
    """
    C = check_num_classes(num_classes)
    p = as_tensor(pred, "pred").long().reshape(-1)
    g = as_tensor(gt, "gt").long().reshape(-1)
    if p.shape != g.shape:
        raise ValueError(f"pred and gt must have the same shape, got {describe(pred)} and {describe(gt)}")
    keep = g != ignore_index
    p, g = p[keep], g[keep]
    if g.numel() and (int(g.min()) < 0 or int(g.max()) > C):
        raise ValueError(f"gt holds class ids outside 0..{C} (num_classes={C}) other than ignore_index={ignore_index}")
    p = torch.where(p == -1, torch.zeros_like(p), p)
    p = torch.where((p < 0) | (p > C), torch.full_like(p, C + 1), p)  # "no class" column
    n = C + 2
    cm = torch.bincount(g * n + p, minlength=n * n).reshape(n, n)[: C + 1]
    return cm.numpy().astype(np.int64)


def segmentation_scores(cm: np.ndarray) -> Dict[str, object]:
    """IoU, FP, FN per class and mIoU from a confusion matrix (rows = gt, columns = pred).

    ``cm`` is (C+1, C+1), or (C+1, C+2) as :func:`confusion_matrix` returns it, whose last
    column counts "no class" predictions: they add to T but to no P.

    Returns a dict with lists ``iou``, ``fp``, ``fn`` (NaN for classes absent from both gt and
    prediction), ``present`` (bool per class) and ``miou`` (mean IoU over present classes).
    """
    cm = np.asarray(cm, dtype=np.float64)
    if cm.ndim != 2 or cm.shape[1] not in (cm.shape[0], cm.shape[0] + 1):
        raise ValueError(f"cm must be a (C+1, C+1) or (C+1, C+2) confusion matrix, got shape {cm.shape}")
    if cm.shape[0] - 1 > MAX_NUM_CLASSES:
        raise ValueError(f"cm has {cm.shape[0]} rows = background + C = {cm.shape[0] - 1} classes, but {RESERVED_REASON}")
    n = cm.shape[0]
    tp = np.diag(cm[:, :n])
    T = cm.sum(1)
    P = cm[:, :n].sum(0)
    union = T + P - tp
    present = union > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(present, tp / union, np.nan)
        fp = np.where(present, (P - tp) / union, np.nan)
        fn = np.where(present, (T - tp) / union, np.nan)
    miou = float(np.nanmean(iou)) if present.any() else float("nan")
    return {
        "iou": iou.tolist(),
        "fp": fp.tolist(),
        "fn": fn.tolist(),
        "present": present.tolist(),
        "miou": miou,
    }


def _fmt(x: float, pct: bool) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return f"{100 * x:.1f}" if pct else f"{x:.3f}"


def format_scores_table(class_names: Sequence[str], columns: Dict[str, Dict[str, object]], *, markdown: bool = True) -> str:
    """One table, a row per class: IoU (%), FP, FN for each named column of scores, then mIoU."""
    if len(class_names) - 1 > MAX_NUM_CLASSES:
        raise ValueError(f"class_names holds {len(class_names)} names = background + {len(class_names) - 1} classes, "
                         f"but {RESERVED_REASON}")
    names = list(columns)
    header = ["class"] + [f"{n} {m}" for n in names for m in ("IoU", "FP", "FN")]
    rows: List[List[str]] = []
    for c, cname in enumerate(class_names):
        row = [cname]
        for n in names:
            s = columns[n]
            row += [_fmt(s["iou"][c], True), _fmt(s["fp"][c], False), _fmt(s["fn"][c], False)]
        rows.append(row)
    rows.append(["mIoU"] + sum(([_fmt(columns[n]["miou"], True), "", ""] for n in names), []))
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in [header] + rows)
