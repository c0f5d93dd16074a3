"""The thumbnails of ``report.html``: per image its picture, pseudo label, debiased label (biased
pixels in :data:`~mars_plugin.pictures.label_images.BIASED_COLOR`) and ground truth, each at most
:data:`THUMB_SIDE` pixels on the longer side, in the VOC palette of the label PNGs.

Pure functions of arrays and paths: the commands run :func:`write_thumbnails` in their I/O
workers (:mod:`mars_plugin.runs.io_pipeline`), one call per image. File names come from the
image's position in the report (never its stem), so a stem with quotes or slashes never reaches
a path or a URL of the page.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, Optional

import numpy as np
import torch

from mars_plugin.formats.files import atomic_write

__all__ = ["THUMB_SIDE", "PANELS", "thumb_names", "fit_thumbnail", "write_thumbnails"]

#: Longest side of a thumbnail (the issue's bound is ~256 px); 160 keeps four panels of a gallery
#: row on a laptop screen and a 10,000-image folder near 4 KB per image.
THUMB_SIDE = 160
#: The panels of an image, in the page's order: file suffix per panel.
PANELS = (("image", ".jpg"), ("pseudo", ".png"), ("debiased", ".png"), ("gt", ".png"))
#: Thumbnails per sub-folder (``thumbs/000/``, ``thumbs/001/``...): no folder of 100,000 entries.
PER_FOLDER = 1000


def thumb_names(index: int, with_gt: bool) -> Dict[str, str]:
    """The relative paths (``thumbs/<index // 1000>/<index>_<panel><ext>``) of image ``index``'s
    thumbnails, panel name -> path; the page builds the same names from the index."""
    folder = f"thumbs/{index // PER_FOLDER:03d}"
    return {panel: f"{folder}/{index:06d}_{panel}{ext}" for panel, ext in PANELS if with_gt or panel != "gt"}


def _size(h: int, w: int) -> tuple:
    """(width, height) at most THUMB_SIDE on the longer side; smaller images keep their size."""
    f = min(1.0, THUMB_SIDE / max(h, w))
    return max(1, round(w * f)), max(1, round(h * f))


def fit_thumbnail(image: np.ndarray, labels: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
    """(H, W, 3) uint8 image and (H, W) label maps (-1 biased) -> RGB panels at most
    :data:`THUMB_SIDE` on the longer side (bilinear for the image, nearest for the labels, so
    every label pixel keeps an exact palette colour)."""
    from PIL import Image

    from mars_plugin.pictures.label_images import colorize_label

    h, w = image.shape[:2]
    size = _size(h, w)
    out = {"image": np.asarray(Image.fromarray(image).resize(size, Image.BILINEAR)) if size != (w, h) else image}
    for name, lab in labels.items():
        rgb = colorize_label(lab)
        out[name] = rgb if size == (w, h) else np.asarray(Image.fromarray(rgb).resize(size, Image.NEAREST))
    return out


def write_thumbnails(out: Path, index: int, image: np.ndarray, labels: Dict[str, torch.Tensor],
                     gt: Optional[torch.Tensor]) -> int:
    """Image ``index``'s thumbnails written into ``out`` (each atomically: a killed run leaves
    whole files or none, and a re-run writes the same bytes); returns the bytes written.
    ``labels``: ``{"pseudo": (H, W), "debiased": (H, W)}``."""
    from PIL import Image

    maps = dict(labels) if gt is None else dict(labels, gt=gt)
    panels = fit_thumbnail(image, maps)
    total = 0
    for panel, rel in thumb_names(index, gt is not None).items():
        path = out / rel
        if panel == "image":
            atomic_write(path, lambda tmp: Image.fromarray(panels[panel]).save(tmp, format="JPEG", quality=85))
        else:  # lossless: every label pixel keeps its palette colour exactly (flat areas: small files)
            atomic_write(path, lambda tmp: Image.fromarray(panels[panel]).save(tmp, format="PNG"))
        total += os.path.getsize(path)
    return total
