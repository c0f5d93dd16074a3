"""Label images for MARS figures: labels in VOC colours, labels blended over images, the "removed
pixels" overlay; and the input checks every figure module shares.

Conventions (the same as :mod:`mars_plugin.formats.files`):

* labels are (H, W) integer maps: 0 = background, 1..C = classes, 255 = ignore, -1 = biased
  (pixels MARS removed from a pseudo label); every id 0..255 is drawn with its PASCAL VOC colour
  (:func:`mars_plugin.formats.files.voc_palette`), so ignore is the VOC off-white (224, 224, 192) and -1
  is :data:`BIASED_COLOR` (bright magenta, a colour the VOC map never produces);
* images are (H, W, 3) uint8 RGB; torch tensors are accepted anywhere an array is and are
  copied to the CPU.
"""
from __future__ import annotations

import numbers
from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from mars_plugin.formats.files import IGNORE_VALUE, voc_palette

__all__ = [
    "BIASED_COLOR",
    "colorize_label",
    "blend",
    "removed_mask_image",
]

#: RGB colour of biased (-1) pixels; no VOC palette entry has a channel above 224, so it is unique.
BIASED_COLOR: Tuple[int, int, int] = (255, 0, 255)

_PALETTE = np.asarray(voc_palette(256), dtype=np.uint8).reshape(256, 3)


# --------------------------------------------------------------------------- input checks


def _describe(x: Any) -> str:
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {x.dtype}"
    return f"{type(x).__name__} {x!r}"[:200]


def _to_numpy(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        try:
            return np.asarray(x)
        except ValueError as e:
            raise ValueError(f"{name} must be an array or tensor, got {_describe(x)}") from e
    raise ValueError(f"{name} must be a numpy array or torch tensor, got {_describe(x)}")


def _check_label(x: Any, name: str) -> np.ndarray:
    """An (H, W) int64 label with values in {-1, 0..255}."""
    arr = _to_numpy(x, name)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be an (H, W) label map, got {_describe(arr)}")
    if arr.dtype == np.bool_ or not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ValueError(f"{name} must be an integer label map, got {_describe(arr)}")
    if np.issubdtype(arr.dtype, np.floating):
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integer class ids, got non-integer values ({_describe(arr)})")
    lab = arr.astype(np.int64)
    if lab.size and (lab.min() < -1 or lab.max() > 255):
        raise ValueError(
            f"{name} values must be -1 (biased), 0..255 (class ids, {IGNORE_VALUE} = ignore), "
            f"got the range [{int(lab.min())}, {int(lab.max())}]"
        )
    return lab


def _check_image(x: Any, name: str) -> np.ndarray:
    """An (H, W, 3) uint8 RGB image: channels last is required (never guessed: a 3x3 image
    reads both ways), and H, W >= 1."""
    arr = _to_numpy(x, name)
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
        hint = (" (channels first? the plots take channels last: image.permute(1, 2, 0) or "
                "np.moveaxis(image, 0, -1))" if arr.ndim == 3 and arr.shape[0] == 3 else "")
        raise ValueError(f"{name} must be an (H, W, 3) uint8 RGB image, got {_describe(arr)}{hint}")
    if arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ValueError(f"{name} must have at least one pixel, got {_describe(arr)}")
    return arr


def _check_same_size(a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    if a.shape[:2] != b.shape[:2]:
        raise ValueError(
            f"{a_name} and {b_name} must have the same height and width, got "
            f"{tuple(a.shape[:2])} and {tuple(b.shape[:2])}"
        )


def _check_fraction(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {_describe(value)}")
    return float(value)


def _check_scale(value: Any, name: str = "scale") -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {_describe(value)}")
    return int(value)


def _check_indices(values: Any, name: str, n: int, *, unique: bool) -> List[int]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray, torch.Tensor)):
        raise ValueError(f"{name} must be a sequence of class indices, got {_describe(values)}")
    out = []
    for v in (values.tolist() if isinstance(values, (np.ndarray, torch.Tensor)) else values):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not 0 <= v < n:
            raise ValueError(f"{name} must hold class indices in 0..{n - 1} (positions in class_names), got {v!r}")
        out.append(int(v))
    if unique and len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a class index, got {out}")
    return out


def _mix(a: np.ndarray, b: np.ndarray, alpha: float) -> np.ndarray:
    """round((1 - alpha) * a + alpha * b) as uint8 (float64 arithmetic, round half to even)."""
    out = (1.0 - alpha) * a.astype(np.float64) + alpha * b.astype(np.float64)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


# --------------------------------------------------------------------------- label images


def colorize_label(label: Any) -> np.ndarray:
    """RGB picture of a label map.

    Args:
        label: (H, W) integer tensor or array; -1 = biased, 0..255 = class ids (0 background,
            255 ignore). Float arrays are accepted when they hold integers.

    Returns:
        (H, W, 3) uint8: VOC palette colour of each id (255 -> (224, 224, 192)), and
        :data:`BIASED_COLOR` for -1.
    """
    lab = _check_label(label, "label")
    rgb = _PALETTE[np.where(lab < 0, 0, lab)]
    rgb[lab == -1] = BIASED_COLOR
    return rgb


def blend(image: Any, label: Any, alpha: float = 0.5) -> np.ndarray:
    """The image with the label's colours laid over it.

    Args:
        image: (H, W, 3) uint8 RGB.
        label: (H, W) label as in :func:`colorize_label`.
        alpha: weight of the label colour in [0, 1].

    Returns:
        (H, W, 3) uint8: background (0) pixels are the image unchanged; every other pixel is
        ``round((1 - alpha) * image + alpha * colorize_label(label))``.
    """
    img = _check_image(image, "image")
    lab = _check_label(label, "label")
    _check_same_size(img, "image", lab, "label")
    alpha = _check_fraction(alpha, "alpha")
    out = _mix(img, colorize_label(lab), alpha)
    bg = lab == 0
    out[bg] = img[bg]
    return out


def removed_mask_image(
    image: Any,
    pseudo: Any,
    debiased: Any,
    *,
    dim: float = 0.4,
    tint: float = 0.35,
) -> np.ndarray:
    """Which pseudo-label pixels MARS removed, over a darkened image.

    Args:
        image: (H, W, 3) uint8 RGB.
        pseudo: (H, W) WSSS pseudo label (0 background, 1..C, 255 ignore).
        debiased: (H, W) debiased label of the same image, -1 on biased pixels.
        dim: brightness kept by the pixels that are not foreground any more, in [0, 1].
        tint: weight of the class colour on kept foreground pixels, in [0, 1].

    Returns:
        (H, W, 3) uint8 where

        * removed pixels (``pseudo`` in 1..254 and ``debiased == -1``) are exactly
          :data:`BIASED_COLOR`;
        * kept foreground pixels (``debiased`` in 1..254) are the full-brightness image tinted
          with their class colour: ``round((1 - tint) * image + tint * colour)``;
        * every other pixel is the image darkened to ``round(dim * image)``.

        With ``dim < 1`` or ``tint > 0`` no other pixel can equal :data:`BIASED_COLOR`
        (VOC colours stay below 225 per channel).
    """
    img = _check_image(image, "image")
    ps = _check_label(pseudo, "pseudo")
    db = _check_label(debiased, "debiased")
    _check_same_size(img, "image", ps, "pseudo")
    _check_same_size(img, "image", db, "debiased")
    dim = _check_fraction(dim, "dim")
    tint = _check_fraction(tint, "tint")

    out = np.clip(np.rint(img.astype(np.float64) * dim), 0, 255).astype(np.uint8)
    kept = (db > 0) & (db != IGNORE_VALUE)
    if kept.any():
        out[kept] = _mix(img[kept], _PALETTE[db[kept]], tint)
    removed = (ps > 0) & (ps != IGNORE_VALUE) & (db == -1)
    out[removed] = BIASED_COLOR
    return out
