"""The one rule by which every command reads an image file into (H, W, 3) uint8 RGB.

:func:`mars_plugin.formats.files.read_image` is the reader (features, debias's CRF image,
predict, report, train's data, reproduce all call it); :func:`to_rgb` is its rule, by PIL mode:

* **8-bit**: ``RGB``, ``L``, ``P``, ``1``, ``RGBX``, ``YCbCr`` and ``CMYK`` are PIL's
  ``convert("RGB")``, which is what the upstream WSSS codebases read (SEAM's and RS+EPM's
  ``Image.open(p).convert("RGB")``; a CMYK JPEG as PIL converts it, Adobe's inverted CMYK
  included).
* **Alpha**: ``RGBA``, ``LA``, ``PA`` and a palette with transparency have their alpha dropped:
  the colours as stored, not composited onto a background. That is what both
  ``convert("RGB")`` and ``cv2.imread(p)`` (``IMREAD_COLOR``) give, so a transparent pixel
  keeps its own colour, whichever upstream reader a user compares with.
* **16-bit integer** (``I;16``, ``I;16L``, ``I;16B``, ``I;16N``: a 16-bit grayscale PNG or
  TIFF): scaled by the bit depth, ``v >> 8`` (the high byte), then grey to RGB. PIL itself reads
  a 16-bit RGB PNG so (it opens as ``RGB`` from the high bytes), and so does ``cv2.imread``'s
  ``IMREAD_COLOR`` for any 16-bit image; a 16-bit ``v * 257`` reads as its 8-bit twin ``v``.
  (PIL's ``convert("RGB")`` *clips* instead: every value above 255 becomes white, 99.6% of
  a full-range image.)
* **32-bit integer** (``I``): scaled by the bit depth the file declares, ``v >> (bits - 8)``:
  16 for a PNG or PGM that PIL opens as ``I`` (their samples are at most 16-bit), a TIFF's
  BitsPerSample, one less for signed samples (SampleFormat 2: the sign bit holds no
  brightness). A negative value, or a format whose depth is unknown, is refused by name.
* **Float** (``F``): values in [0, 1] are ``round(v * 255)`` (a float image in [0, 1] is the
  common convention; PIL would truncate them all to 0 or 1). Any value outside [0, 1], or not
  finite, is refused, naming the range found: there is no scale to read it by.
* **Any other mode** (``LAB``, ``HSV``, premultiplied ``RGBa``/``La``, ...) is refused, naming the file and its mode.
* **EXIF orientation is not applied**: the pixels as stored, as PIL's ``Image.open``,
  ``imageio.imread`` and the upstream VOC/COCO pipelines read them. Masks and pseudo labels are
  drawn on the stored pixels and every size check reads the stored size from the header, so
  applying a rotation would misalign image and label (or make their sizes differ).
* A multi-frame file (GIF, TIFF) gives its first frame, as ``Image.open`` does.
"""
from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

__all__ = ["READABLE_MODES", "to_rgb", "check_image_mode"]

#: PIL modes read by ``convert("RGB")`` (alpha and transparency dropped).
_CONVERTED = ("RGB", "L", "P", "1", "RGBX", "YCbCr", "CMYK", "RGBA", "LA", "PA")
#: 16-bit unsigned integer modes: read as ``v >> 8``.
_SIXTEEN = ("I;16", "I;16L", "I;16B", "I;16N")
#: Every mode :func:`to_rgb` reads; any other is refused naming it.
READABLE_MODES = _CONVERTED + _SIXTEEN + ("I", "F")


def check_image_mode(path: str, mode: str) -> None:
    """A ValueError naming ``path`` and ``mode`` when :func:`to_rgb` has no rule for the mode
    (a header-only check: the values of ``I`` and ``F`` images are checked when read)."""
    if mode not in READABLE_MODES:
        raise ValueError(f"{path}: image mode {mode} is not read by mars (readable: 8-bit RGB, L, P, CMYK, YCbCr, "
                         "with or without alpha, which is dropped; 16- and 32-bit integer grey, scaled by the "
                         "bit depth; float grey in [0, 1]); convert it to 8-bit RGB")


def _bits_of_int32(im, path: str) -> int:
    """Magnitude bits of an ``I``-mode image's samples, from what its file declares."""
    if im.format in ("PNG", "PPM"):  # a 16-bit PNG (older PIL) or PGM; PIL scales a PGM to 16 bits
        return 16
    if im.format == "TIFF":
        bits = im.tag_v2.get(258, (32,))
        bits = int(bits[0] if isinstance(bits, tuple) else bits)
        fmt = im.tag_v2.get(339, (1,))
        signed = int(fmt[0] if isinstance(fmt, tuple) else fmt) == 2
        return bits - signed
    raise ValueError(f"{path}: a 32-bit integer (mode I) {im.format or 'unknown-format'} image, whose bit depth "
                     "mars cannot tell (it reads PNG, PGM and TIFF integer images); convert it to 8-bit RGB")


def _scaled(arr: np.ndarray, bits: int, path: str, mode: str) -> np.ndarray:
    """Integer samples of ``bits`` magnitude bits as uint8, ``v >> (bits - 8)``."""
    if arr.size and int(arr.min()) < 0:
        raise ValueError(f"{path}: a mode {mode} image holds negative values (min {int(arr.min())}); mars reads "
                         "integer images of non-negative brightness only")
    if arr.size and int(arr.max()) >> bits:
        raise ValueError(f"{path}: a mode {mode} image declares {bits}-bit samples but holds {int(arr.max())}")
    shift = max(bits - 8, 0)
    return (arr.astype(np.int64) >> shift).astype(np.uint8)


def _grey_to_rgb(grey: np.ndarray) -> np.ndarray:
    return np.repeat(grey[:, :, None], 3, axis=2)


def to_rgb(im, path: Optional[str] = None) -> np.ndarray:
    """(H, W, 3) uint8 RGB of an open PIL image, by the rule of this module's docstring; a
    ValueError naming ``path`` (default: the image's own file name) and the mode for a mode or
    range it refuses."""
    path = path if path is not None else getattr(im, "filename", "") or "<image>"
    mode = im.mode
    check_image_mode(path, mode)
    if mode in _CONVERTED:
        with warnings.catch_warnings():
            # "Palette images with Transparency expressed in bytes should be converted to RGBA":
            # dropping it is this rule, not an accident to warn about
            warnings.simplefilter("ignore", UserWarning)
            return np.array(im.convert("RGB"), dtype=np.uint8)
    arr = np.asarray(im)
    if mode in _SIXTEEN:
        return _grey_to_rgb(_scaled(arr, 16, path, mode))
    if mode == "I":
        return _grey_to_rgb(_scaled(arr, _bits_of_int32(im, path), path, mode))
    # mode F
    finite = np.isfinite(arr)
    if not finite.all():
        raise ValueError(f"{path}: a float (mode F) image holds {int((~finite).sum())} values that are not finite; "
                         "mars reads float images with values in [0, 1]")
    lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    if lo < 0 or hi > 1:
        raise ValueError(f"{path}: a float (mode F) image with values in [{lo:g}, {hi:g}]; mars reads float images "
                         "with values in [0, 1] (scaled by 255) and has no scale for others: convert it to 8-bit RGB")
    return _grey_to_rgb(np.rint(arr.astype(np.float64) * 255).astype(np.uint8))
