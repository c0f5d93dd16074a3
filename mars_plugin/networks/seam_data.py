"""The training augmentation of SEAM's segmentation codebase (the SEAM row), without OpenCV.

Read from YudeWang/semantic-segmentation-codebase at a40f6c6: config.py:19-26 (``DATA_MEAN``,
``DATA_STD``, ``DATA_RANDOMCROP`` 448, ``DATA_RANDOMSCALE`` [0.5, 1.5], ``DATA_RANDOM_H/S/V``
10, ``DATA_RANDOMFLIP`` 0.5), lib/datasets/BaseDataset.py:88-98 (``__weak_augment__``: HSV,
flip, scale, normalise, crop, in this order) and lib/datasets/transform.py. The image is RGB
uint8 (VOCDataset.py:61-66), the label the PNG's bytes (:74-78). Per sample, with upstream's
draws from Python's ``random`` in this order:

1. ``RandomHSV`` (transform.py:76-102): ``cv2.cvtColor(RGB2HSV)`` (H in 0..179), three draws
   ``randint(-10, 10)`` for H, S, V; H ``(h + dh) % 180``, S and V clipped to 0..255; back with
   ``cv2.cvtColor(HSV2RGB)``.
2. ``RandomFlip`` (:104-124): ``random() < 0.5`` mirrors image and label.
3. ``RandomScale`` (:126-149): ``s = random() * (1.5 - 0.5) + 0.5``; ``cv2.resize(fx=s, fy=s)``,
   the image ``INTER_CUBIC`` (uint8 in, uint8 out), the label ``INTER_NEAREST``; the size is
   ``round(W s) x round(H s)``.
4. ``ImageNorm`` (:151-168): float32 ``(x / 255 - mean) / std``.
5. ``RandomCrop`` (:12-74) to 448 x 448: per axis (width first) ``randrange(W - 448 + 1)``
   for the window's place when the image is larger, else ``randrange(448 - W + 1)`` for the
   image's place in the crop; the padding is **0 after normalisation** and 255 in the label.

OpenCV's three routines are reimplemented here in numpy (:func:`cv_rgb2hsv`,
:func:`cv_hsv2rgb`, :func:`cv_resize`), by OpenCV's own arithmetic (uint8 HSV tables with
12-bit fixed point; HSV back in float32; bicubic with A = -0.75, coordinates
``(d + 0.5) / s - 0.5`` in float32, 11-bit integer weights, clamped borders).

:func:`seam_augment` has the interface of :func:`mars_plugin.networks.seg_data.augment`
(uint8 crop, the padding the rounded mean colour, which normalises to within 0.009 of 0: ``mars
train``'s input sets the padding to exactly 0, :func:`mars_plugin.networks.seg_data.train_sample`);
:func:`seam_augment_normalized` returns upstream's float32 crop itself, 0 in the padding.
"""
from __future__ import annotations

import random as _random
from dataclasses import dataclass
from typing import Any, Sequence, Tuple, Union

import numpy as np

__all__ = ["SeamAugmentation", "seam_augmentation", "seam_augment", "seam_augment_window", "seam_augment_normalized", "cv_rgb2hsv", "cv_hsv2rgb", "cv_resize"]

Rng = Union[_random.Random, np.random.Generator]


@dataclass(frozen=True)
class SeamAugmentation:
    """The numbers of the augmentation (defaults: config.py:19-26)."""

    crop: int = 448
    scale: Tuple[float, float] = (0.5, 1.5)
    hsv: Tuple[int, int, int] = (10, 10, 10)
    flip: float = 0.5
    mean: Tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: Tuple[float, float, float] = (0.229, 0.224, 0.225)

    def __post_init__(self) -> None:
        if isinstance(self.crop, bool) or not isinstance(self.crop, int) or self.crop < 8:
            raise ValueError(f"crop must be an integer >= 8, got {self.crop!r}")
        lo, hi = self.scale
        if not 0 < lo <= hi:
            raise ValueError(f"scale must be (low, high) with 0 < low <= high, got {self.scale!r}")
        if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 255 for v in self.hsv):
            raise ValueError(f"hsv must be three integers in 0..255, got {self.hsv!r}")
        if not 0.0 <= self.flip <= 1.0:
            raise ValueError(f"flip must be a probability in [0, 1], got {self.flip!r}")


def seam_augmentation(crop: int, params: Sequence[Tuple[str, Any]]) -> SeamAugmentation:
    """The :class:`SeamAugmentation` of a recipe's ``crop`` and ``augmentation_params``
    (``scale``, ``hsv``, ``hflip``: :mod:`mars_plugin.networks.recipes`, recipe ``seam``)."""
    p = dict(params)
    return SeamAugmentation(crop=crop, scale=tuple(p["scale"]), hsv=tuple(int(v) for v in p["hsv"]),
                            flip=float(p["hflip"]))


class _Draws:
    """Upstream's draws from Python's ``random``: the same calls on a ``random.Random`` (the
    same stream as upstream's for the same state), or their equivalents on a numpy Generator."""

    def __init__(self, rng: Rng) -> None:
        if not isinstance(rng, (_random.Random, np.random.Generator)):
            raise TypeError(f"rng must be a random.Random or a numpy Generator, got {type(rng).__name__}")
        self.rng = rng

    def randint(self, a: int, b: int) -> int:
        r = self.rng
        return r.randint(a, b) if isinstance(r, _random.Random) else int(r.integers(a, b + 1))

    def random(self) -> float:
        return float(self.rng.random())

    def randrange(self, n: int) -> int:
        r = self.rng
        return r.randrange(n) if isinstance(r, _random.Random) else int(r.integers(0, n))


# --- OpenCV's routines ---------------------------------------------------------------------

_HSV_SHIFT = 12


def _tables() -> Tuple[np.ndarray, np.ndarray]:
    # OpenCV color_hsv: sdiv[i] = round((255 << 12) / i), hdiv180[i] = round((180 << 12) / (6 i)),
    # both 0 at i = 0; cvRound rounds half to even, as np.rint
    i = np.arange(1, 256, dtype=np.float64)
    sdiv = np.zeros(256, np.int64)
    hdiv = np.zeros(256, np.int64)
    sdiv[1:] = np.rint((255 << _HSV_SHIFT) / i)
    hdiv[1:] = np.rint((180 << _HSV_SHIFT) / (6.0 * i))
    return sdiv, hdiv


_SDIV, _HDIV = _tables()


def cv_rgb2hsv(rgb: np.ndarray) -> np.ndarray:
    """``cv2.cvtColor(rgb, cv2.COLOR_RGB2HSV)`` of (H, W, 3) uint8: H 0..179, S and V 0..255."""
    r, g, b = (rgb[..., k].astype(np.int64) for k in range(3))
    v = np.maximum(np.maximum(b, g), r)
    diff = v - np.minimum(np.minimum(b, g), r)
    half = 1 << (_HSV_SHIFT - 1)
    s = (diff * _SDIV[v] + half) >> _HSV_SHIFT
    h = np.where(v == r, g - b, np.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (h * _HDIV[diff] + half) >> _HSV_SHIFT
    h = np.where(h < 0, h + 180, h)
    return np.stack([h, s, v], -1).astype(np.uint8)


#: OpenCV 4.x's ``HSV2RGB_b`` converts 4 SIMD vectors of float32 at a time: 32 pixels with AVX2.
_HSV_BLOCK = 32


def cv_hsv2rgb(hsv: np.ndarray, block: int = _HSV_BLOCK) -> np.ndarray:
    """``cv2.cvtColor(hsv, cv2.COLOR_HSV2RGB)`` of (H, W, 3) uint8 (H 0..179), in float32 as
    OpenCV 4.x's ``HSV2RGB_b`` (color_hsv.simd.hpp; the codebase asks for opencv_python >=
    4.3): the value times 255 is **truncated** to a byte in the SIMD part of each row (the
    first ``W // block * block`` pixels; ``block`` 32 on an AVX2 CPU, 16 with SSE4.1 only) and
    **rounded** in the scalar tail. Checked equal on all 180 x 256 x 256 inputs to
    opencv-python-headless's build on an AVX2 CPU."""
    f32 = np.float32
    h = hsv[..., 0].astype(f32) * f32(6.0 / 180.0)
    s = hsv[..., 1].astype(f32) * f32(1.0 / 255.0)
    v = hsv[..., 2].astype(f32) * f32(1.0 / 255.0)
    h = np.fmod(h, f32(6.0))
    sector = np.floor(h).astype(np.int64)
    h = h - sector.astype(f32)
    bad = (sector < 0) | (sector >= 6)
    sector = np.where(bad, 0, sector)
    h = np.where(bad, f32(0), h).astype(f32)
    one = f32(1.0)
    # 1 - s h and 1 - s (1 - h) are fused multiply-adds in OpenCV's AVX2 build (GCC contracts
    # them): the product is exact in float64, then one rounding to float32
    s64 = s.astype(np.float64)
    tab2 = (1.0 - s64 * h.astype(np.float64)).astype(f32)
    tab3 = (1.0 - s64 * (one - h).astype(np.float64)).astype(f32)
    tab = np.stack([v, v * (one - s), v * tab2, v * tab3], 0)
    order = np.array([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]])  # b, g, r
    pick = order[sector]  # (H, W, 3) indices into tab
    bgr = np.take_along_axis(tab, np.moveaxis(pick, -1, 0), 0)
    bgr = np.where((s == 0)[None], v[None], bgr)
    scaled = bgr * f32(255.0)
    simd = np.arange(hsv.shape[1]) < hsv.shape[1] // block * block
    out = np.clip(np.where(simd[None, None, :], np.trunc(scaled), np.rint(scaled)), 0, 255).astype(np.uint8)
    return np.stack([out[2], out[1], out[0]], -1)


def _cubic_weights(n_out: int, n_in: int, inv_scale: float) -> Tuple[np.ndarray, np.ndarray]:
    """OpenCV's bicubic taps for one axis: (n_out, 4) clamped source indices and float32 weights
    (``interpolateCubic``, A = -0.75, at ``(d + 0.5) / s - 0.5`` computed in double, stored float)."""
    f32 = np.float32
    d = np.arange(n_out, dtype=np.float64)
    fx = ((d + 0.5) * (1.0 / inv_scale) - 0.5).astype(f32)
    sx = np.floor(fx).astype(np.int64)
    x = (fx - sx.astype(f32)).astype(f32)
    A, one = f32(-0.75), f32(1)
    c0 = ((A * (x + one) - f32(5) * A) * (x + one) + f32(8) * A) * (x + one) - f32(4) * A
    c1 = ((A + f32(2)) * x - (A + f32(3))) * x * x + one
    c2 = ((A + f32(2)) * (one - x) - (A + f32(3))) * (one - x) * (one - x) + one
    c3 = one - c0 - c1 - c2
    idx = np.clip(sx[:, None] + np.arange(-1, 3)[None], 0, n_in - 1)
    return idx, np.stack([c0, c1, c2, c3], 1).astype(f32)


def cv_resize(img: np.ndarray, scale: float, interpolation: str) -> np.ndarray:
    """``cv2.resize(img, None, fx=scale, fy=scale, interpolation=...)`` of a uint8 or float32
    (H, W) or (H, W, C) array (float32 stays float32, unrounded: test.py's scales of the
    normalised image); ``interpolation`` ``"cubic"`` or ``"nearest"``. The output is
    ``round(W s) x round(H s)`` (half to even); an unchanged size is a copy (cv2.resize does
    that too). ``"nearest"``: source ``min(floor(d / s), n - 1)``, as OpenCV. ``"cubic"``:
    separable, rows then columns, in float32 with float32 weights, clamped borders, rounded half
    to even; opencv-python 4.10 (the codebase asks for >= 4.3) gives the same bytes on all but
    about 0.1% of the values of random images, which differ by 1 (its order of the float
    operations is not reproduced)."""
    H, W = img.shape[:2]
    oh, ow = int(np.rint(H * scale)), int(np.rint(W * scale))
    if oh <= 0 or ow <= 0:
        raise ValueError(f"scale {scale} leaves an empty image from {H}x{W}")
    if (oh, ow) == (H, W):
        return img.copy()
    if interpolation == "nearest":
        ys = np.minimum(np.floor(np.arange(oh) * (1.0 / scale)).astype(np.int64), H - 1)
        xs = np.minimum(np.floor(np.arange(ow) * (1.0 / scale)).astype(np.int64), W - 1)
        return img[ys][:, xs]
    if interpolation != "cubic":
        raise ValueError(f"interpolation must be 'cubic' or 'nearest', got {interpolation!r}")
    yi, yw = _cubic_weights(oh, H, scale)
    xi, xw = _cubic_weights(ow, W, scale)
    extra = (None,) * (img.ndim - 2)
    src = img.astype(np.float32)
    taps = src[:, xi]  # (H, ow, 4[, C])
    rows = sum(taps[:, :, k] * xw[(None, slice(None), k) + extra] for k in range(4))
    vtaps = rows[yi]  # (oh, 4, ow[, C])
    out = sum(vtaps[:, k] * yw[(slice(None), k, None) + extra] for k in range(4))
    if img.dtype == np.float32:
        return out.astype(np.float32)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


# --- the augmentation ------------------------------------------------------------------------

def _crop_parts(rgb: np.ndarray, label: np.ndarray, aug: SeamAugmentation, rng: Rng
                ) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int, int, int]]:
    """Steps 1-3 and the crop's draws: (scaled uint8 RGB, scaled label, (img_top, img_left,
    cont_top, cont_left))."""
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3):
        raise ValueError(f"rgb must be a uint8 array (H, W, 3), got {type(rgb).__name__} "
                         f"{getattr(rgb, 'dtype', '')} {getattr(rgb, 'shape', '')}")
    if not (isinstance(label, np.ndarray) and label.dtype == np.uint8 and label.shape == rgb.shape[:2]):
        raise ValueError(f"label must be a uint8 array {rgb.shape[:2]} (the image's H, W), got "
                         f"{getattr(label, 'dtype', '')} {getattr(label, 'shape', '')}")
    draws = _Draws(rng)
    hsv = cv_rgb2hsv(rgb).astype(np.int64)
    dh, ds, dv = (draws.randint(-r, r) for r in aug.hsv)
    hsv[..., 0] = (hsv[..., 0] + dh) % 180
    hsv[..., 1] = np.clip(hsv[..., 1] + ds, 0, 255)
    hsv[..., 2] = np.clip(hsv[..., 2] + dv, 0, 255)
    img = cv_hsv2rgb(hsv.astype(np.uint8))
    lab = label
    if draws.random() < aug.flip:
        img, lab = img[:, ::-1], lab[:, ::-1]
    s = draws.random() * (aug.scale[1] - aug.scale[0]) + aug.scale[0]
    img = cv_resize(np.ascontiguousarray(img), s, "cubic")
    lab = cv_resize(np.ascontiguousarray(lab), s, "nearest")
    h, w = lab.shape
    c = aug.crop
    places = []
    for space in (w - c, h - c):  # transform.py:37-49: the width's draw first
        places.append((0, draws.randrange(space + 1)) if space > 0 else (draws.randrange(-space + 1), 0))
    (cont_left, img_left), (cont_top, img_top) = places
    return img, lab, (img_top, img_left, cont_top, cont_left)


def _paste(src: np.ndarray, fill: np.ndarray, box: Tuple[int, int, int, int], c: int) -> np.ndarray:
    img_top, img_left, cont_top, cont_left = box
    ch, cw = min(src.shape[0], c), min(src.shape[1], c)
    fill[cont_top:cont_top + ch, cont_left:cont_left + cw] = src[img_top:img_top + ch, img_left:img_left + cw]
    return fill


def seam_augment_normalized(rgb: np.ndarray, label: np.ndarray, aug: SeamAugmentation, rng: Rng
                            ) -> Tuple[np.ndarray, np.ndarray]:
    """Upstream's training sample itself: (H, W, 3) uint8 RGB and (H, W) uint8 label -> the
    normalised float32 crop (crop, crop, 3), 0 in the padding, and the uint8 label crop, 255 in
    the padding. ``rng``: a ``random.Random`` (upstream's stream) or a numpy Generator."""
    img, lab, box = _crop_parts(rgb, label, aug, rng)
    x = img.astype(np.float32)
    for k in range(3):  # ImageNorm in float32, one channel at a time
        x[..., k] = (x[..., k] / np.float32(255) - np.float32(aug.mean[k])) / np.float32(aug.std[k])
    c = aug.crop
    out = _paste(x, np.zeros((c, c, 3), np.float32), box, c)
    return out, _paste(lab, np.full((c, c), 255, np.uint8), box, c)


def seam_augment(rgb: np.ndarray, label: np.ndarray, aug: SeamAugmentation, rng: Rng
                 ) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`mars_plugin.networks.seg_data.augment`'s interface: (H, W, 3) uint8 RGB and (H, W)
    uint8 label -> (crop, crop, 3) uint8 RGB and (crop, crop) uint8 label, 255 where padded.
    The padding is ``round(255 * mean)`` (upstream's 0 after normalisation is not a byte); the
    rest normalises to exactly :func:`seam_augment_normalized`'s values."""
    return seam_augment_window(rgb, label, aug, rng)[:2]


def seam_augment_window(rgb: np.ndarray, label: np.ndarray, aug: SeamAugmentation, rng: Rng
                        ) -> Tuple[np.ndarray, np.ndarray, Tuple[int, int, int, int]]:
    """:func:`seam_augment`'s crop, and the window (top, left, height, width) the image fills
    in it: outside it upstream's normalised crop is 0 (:func:`mars_plugin.networks.seg_data.train_sample`)."""
    img, lab, box = _crop_parts(rgb, label, aug, rng)
    c = aug.crop
    fill = np.empty((c, c, 3), np.uint8)
    fill[:] = [int(round(255 * m)) for m in aug.mean]
    window = (box[2], box[3], min(img.shape[0], c), min(img.shape[1], c))
    return _paste(img, fill, box, c), _paste(lab, np.full((c, c), 255, np.uint8), box, c), window
