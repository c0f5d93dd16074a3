"""The yardstick of ``mars reproduce``: other methods' masks in DHR's ``WSS/<data>/`` folders.

DHR's "WSS labels" download (``README.md`` of shjo-april/DHR, "Training the WSS method") holds
``WSS/VOC2012/{RSEPM,MARS,DHR}/train_aug/<id>.png``: RS+EPM's pseudo labels (the paper's input),
**the MARS authors' own masks** (the only real output of the method anyone has) and DHR's. This
module scores each such folder against the ground truth exactly as our labels are scored, and
measures how far our debiased labels agree with it.

Definitions (one pass over the evaluated ids; ``gt`` the ground-truth mask, ``ours`` our
debiased label, ``theirs`` the reference's mask):

* ``scores[name]``: :func:`~mars_plugin.commands.metrics.segmentation_scores` of ``theirs`` against ``gt``
  (``miou``, ``iou``, ``fp``, ``fn``, ``present``, ``confusion``, ``num_images``): the schema of
  ``scores.json``'s ``"pseudo"``.
* ``agreement[name]``: over the *valid* pixels (``gt`` not ignored and neither label map 255):
  ``pixel`` = share of them where ``ours == theirs``, a biased pixel of ours (254) never
  agreeing; ``iou[c]`` = |ours = c and theirs = c| / |ours = c or theirs = c| (NaN where neither
  has class c; a biased pixel is in no class of ours); ``miou`` their mean over the classes
  either map has; ``pixels`` = the number of valid pixels.

A reference is a method's final masks, so it must hold only 0..C and 255, have a mask of its
image's size for every evaluated id, and never hold 254 (that is our "biased" byte: DHR cannot
train on it). A reference that breaks one of these is a bad tree: ``on_error="stop"`` raises one
line naming the folder and the first offending file; ``"skip"`` leaves that reference out whole
(so that every score shown is over the same images) and names it.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.formats.files import BIASED_VALUE, IGNORE_VALUE, check_stem, list_stems, read_label
from mars_plugin.commands.metrics import confusion_matrix, segmentation_scores

__all__ = ["find_references", "check_references", "score_references", "RESERVED_KEYS", "describe_reference"]

PathLike = os.PathLike

#: Keys of scores.json that are not reference names; a folder with such a name is stored as
#: ``"<name> (reference)"``.
RESERVED_KEYS = ("pseudo", "debiased", "agreement", "class_names", "references")

#: What the folders of DHR's "WSS labels" download hold, for report.md.
_KNOWN = {
    "MARS": "the MARS authors' masks: their segmentation network (trained on debiased labels with the EMA "
            "teacher and WCE, Eq. 6-7) predicting train_aug with the CRF, i.e. *after* training; our debiased "
            "labels come *before* it",
    "RSEPM": "RS+EPM's pseudo labels (the paper's input, before MARS)",
    "DHR": "DHR's masks (the authors' later method, after its own training)",
}


def describe_reference(name: str) -> str:
    """One phrase saying what a WSS folder holds (known folders of DHR's download, else generic)."""
    return _KNOWN.get(name.upper().replace("+", "").replace("-", ""), "another method's masks")


def scores_key(name: str) -> str:
    """The key of reference ``name`` in scores.json (never one of :data:`RESERVED_KEYS`)."""
    return f"{name} (reference)" if name in RESERVED_KEYS else name


def find_references(wss_data_dir: PathLike, domain: str, pseudo_dir: PathLike) -> Tuple[Dict[str, Path], List[str]]:
    """The method folders ``<wss_data_dir>/<name>/<domain>/`` other than the pseudo labels'.

    Returns ``({name: folder}, notes)``, sorted by name; ``notes`` names each folder left out
    and why (it is the ``--pseudo`` folder, or it has no ``<domain>`` folder). A missing
    ``wss_data_dir`` gives ``({}, [])``.
    """
    base = Path(wss_data_dir)
    if not base.is_dir():
        return {}, []
    check_stem(domain)
    pseudo = Path(pseudo_dir).resolve()
    found: Dict[str, Path] = {}
    notes: List[str] = []
    for d in sorted(p for p in base.iterdir() if p.is_dir() and not p.name.startswith(".")):
        folder = d / domain
        if pseudo in (d.resolve(), folder.resolve()):
            notes.append(f"{d}: the --pseudo folder, not a reference")
        elif not folder.is_dir():
            notes.append(f"{d}: no {domain}/ folder, not a reference for this domain")
        else:
            found[d.name] = folder
    return found, notes


def check_references(references: Dict[str, Path], stems: Sequence[str]) -> Dict[str, str]:
    """{name: why} for each reference lacking a mask for some of ``stems`` (a cheap listing,
    before any mask is read)."""
    bad: Dict[str, str] = {}
    for name, folder in references.items():
        have = set(list_stems(folder, (".png",)))
        missing = [s for s in stems if s not in have]
        if missing:
            bad[name] = (f"{folder}: no mask for {len(missing)} of the {len(stems)} evaluated ids "
                         f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})")
    return bad


def _read_reference(path: Path, num_classes: int, shape: Tuple[int, ...]) -> torch.Tensor:
    ref = read_label(path, biased_value=None)
    if tuple(ref.shape) != shape:
        raise ValueError(f"{path}: {tuple(ref.shape)[0]}x{tuple(ref.shape)[1]} but the ground truth is "
                         f"{shape[0]}x{shape[1]}; a reference mask must have its image's size")
    vals = torch.unique(ref)
    if bool((vals == BIASED_VALUE).any()):
        raise ValueError(f"{path}: holds {BIASED_VALUE}, the 'biased' byte of debiased labels; a reference is a "
                         f"method's final mask (0..{num_classes} and {IGNORE_VALUE} only)")
    odd = vals[(vals > num_classes) & (vals != IGNORE_VALUE)]
    if odd.numel():
        raise ValueError(f"{path}: holds {int(odd[0])}; a reference mask holds classes 0..{num_classes} and "
                         f"{IGNORE_VALUE} (ignore) only")
    return ref


def score_references(
    references: Dict[str, Path],
    ours_dir: PathLike,
    gt_dir: PathLike,
    stems: Sequence[str],
    num_classes: int,
    *,
    on_error: str = "stop",
    progress: bool = True,
) -> Tuple[Dict[str, dict], Dict[str, dict], List[Tuple[str, str]]]:
    """Score every reference against ``gt_dir`` and its agreement with ``ours_dir`` on ``stems``.

    Returns ``(scores, agreement, left_out)`` keyed by reference name (see the module
    docstring for the definitions); ``left_out`` lists ``(name, why)`` of the references
    dropped under ``on_error="skip"``. With ``"stop"`` the first bad reference raises a
    ValueError naming it. Our labels and the ground truth are read by the caller's job
    before; here they are read once per image and every reference is compared on that read.
    """
    if on_error not in ("stop", "skip"):
        raise ValueError(f"on_error must be 'stop' or 'skip', got {on_error!r}")
    C = int(num_classes)
    left_out: List[Tuple[str, str]] = []
    refs = dict(references)
    for name, why in check_references(refs, stems).items():
        _leave_out(name, why, on_error, left_out)
        del refs[name]
    if not refs:
        return {}, {}, left_out
    tallies = {name: _Tally(C) for name in refs}
    it = stems
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(stems, desc="references", unit="img")
    for stem in it:
        gt = read_label(Path(gt_dir) / f"{stem}.png", biased_value=None)
        ours = read_label(Path(ours_dir) / f"{stem}.png", biased_value=None)
        for name in list(refs):
            try:
                theirs = _read_reference(refs[name] / f"{stem}.png", C, tuple(gt.shape))
            except (ValueError, OSError) as e:
                _leave_out(name, str(e), on_error, left_out)
                del refs[name], tallies[name]
                continue
            tallies[name].add(theirs, gt, ours)
    scores = {name: tally.scores(len(stems)) for name, tally in tallies.items()}
    agreement = {name: tally.agreement() for name, tally in tallies.items()}
    return scores, agreement, left_out


def _leave_out(name: str, why: str, on_error: str, left_out: List[Tuple[str, str]]) -> None:
    """A bad reference: one line naming it (``on_error="stop"``), or listed in ``left_out``."""
    if on_error == "stop":
        raise ValueError(f"reference {name}: {why}; use --on-error skip to leave it out") from None
    left_out.append((name, why))


class _Tally:
    """One reference's counts over the images: its confusion against the ground truth and, over
    the valid pixels, its agreement with ours (per class and in all)."""

    def __init__(self, num_classes: int) -> None:
        self.C, n = num_classes, num_classes + 1
        self.cm: Optional[torch.Tensor] = None
        self.inter, self.union = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.same = self.valid = 0

    def add(self, theirs: torch.Tensor, gt: torch.Tensor, ours: torch.Tensor) -> None:
        """Count one image."""
        C, n = self.C, self.C + 1
        m = confusion_matrix(theirs, gt, C, ignore_index=IGNORE_VALUE)
        self.cm = m if self.cm is None else self.cm + m
        keep = (gt != IGNORE_VALUE) & (ours != IGNORE_VALUE) & (theirs != IGNORE_VALUE)
        o, t = ours[keep].long(), theirs[keep].long()
        self.valid += int(keep.sum())
        self.same += int((o == t).sum())  # 254 never equals a reference value (0..C)
        o_cls = torch.bincount(o[o <= C], minlength=n).numpy()
        t_cls = torch.bincount(t, minlength=n).numpy()
        both = torch.bincount(o[o == t], minlength=n).numpy()
        self.inter += both
        self.union += o_cls + t_cls - both

    def scores(self, num_images: int) -> dict:
        """The reference's scores against the ground truth (``scores.json``'s schema)."""
        s = segmentation_scores(self.cm)
        s["confusion"] = self.cm.tolist()
        s["num_images"] = num_images
        return s

    def agreement(self) -> dict:
        """Its agreement with our debiased labels (see the module docstring)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            iou = np.where(self.union > 0, self.inter / np.maximum(self.union, 1), np.nan)
        has = self.union > 0
        return {
            "pixel": self.same / self.valid if self.valid else math.nan,
            "iou": iou.tolist(),
            "miou": float(iou[has].mean()) if has.any() else math.nan,
            "pixels": int(self.valid),
        }


def reference_summary(name: str, score: dict, agree: Optional[dict]) -> str:
    """One line for the console: a reference's mIoU and its agreement with ours."""
    line = f"  reference {name}: mIoU {100 * score['miou']:.1f}"
    if agree is not None and not math.isnan(agree["pixel"]):
        line += f", agrees with our debiased labels on {100 * agree['pixel']:.1f}% of the pixels"
    return line
