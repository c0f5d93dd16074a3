"""deeplab-pytorch's training pieces (the IRNet/AdvCAM rows), as functions a trainer calls.

Read from kazuto1011/deeplab-pytorch at 4219467fa5de07985f834f1bd8c04c186dc8f6d8 (line numbers
of those files) with configs/voc12.yaml's numbers:

* **Augmentation** (libs/datasets/base.py:60-113, voc.py:84-85): the image as cv2 reads it (BGR,
  float32) and the label (int32); a scale drawn from ``SCALES`` [0.5, 0.75, 1.0, 1.25, 1.5]
  (``random.choice``), the size ``(int(h * s), int(w * s))``, the image resized by
  ``cv2.INTER_LINEAR`` in float32, the label by PIL ``NEAREST``; padded at the bottom and right
  to the crop (321) with the mean colour and 255; a random 321 x 321 window (``random.randint``
  for the top, then the left); a horizontal flip with probability 0.5 (``random.random() <
  0.5``); then the mean (B 104.008, G 116.669, R 122.675) subtracted, no std, channels first.
  :func:`augment_bgr` gives that array; :func:`augment` the same crop as uint8 RGB, the
  interface of :func:`mars_plugin.networks.seg_data.augment`.
* **Normalisation** (:func:`normalize`): uint8 RGB -> BGR minus the mean, as base.py:110.
* **SGD groups** (main.py:48-67, 161-181): the convs of the ``layer*`` modules at lr with weight
  decay, the ASPP conv weights at 10 lr with decay, the ASPP biases at 20 lr without; BatchNorm
  is in no group (main.py:206-208 freezes it: eval mode, never stepped).
* **Poly learning rate** (libs/utils/lr_scheduler.py, main.py:184-189 and :250): ``step_size``
  10, ``iter_max`` 20000, ``power`` 0.9; ``scheduler.step(epoch=iteration)`` after the
  iteration's optimizer step sets ``base * (1 - iteration / iter_max) ** power`` when iteration
  is a multiple of 10 (and <= iter_max), else leaves the lr; so iterations 1..10 run at base, 11..20 at
  ``base * (1 - 10 / iter_max) ** 0.9``, ... (:func:`poly_lr`).
* **Loss** (main.py:70-83, 157, 228-240): for every MSC output (1x, 0.5x, 0.75x, max), the labels
  resized to its size by PIL ``NEAREST`` (:func:`resize_labels_nearest`, PIL's arithmetic), the
  mean cross-entropy ignoring 255; summed, divided by ``ITER_SIZE`` (2) (:func:`msc_loss`).

Where we differ, and why: upstream draws with Python's ``random`` module; :func:`augment` takes
a ``random.Random`` (then its calls are upstream's, one for one) or a numpy Generator (then the
same draws in the same order from it, as ``mars train`` seeds its samples). cv2 is not a
dependency: :func:`_resize_linear` is its ``INTER_LINEAR`` arithmetic (half-pixel centres, the
weights in float32, edge pixels repeated), equal to cv2's float32 result to 2 float32 ulps.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import check_real_param, describe

__all__ = ["MEAN_BGR", "DeeplabAugmentation", "augment", "augment_bgr", "train_sample", "normalize", "param_groups",
           "poly_lr", "resize_labels_nearest", "msc_loss", "msc_step_loss"]

#: configs/voc12.yaml:21-24 (IMAGE.MEAN), in base.py's (B, G, R) order (main.py:121).
MEAN_BGR = (104.008, 116.669, 122.675)
_IGNORE = 255  # configs/voc12.yaml:10 IGNORE_LABEL

Rng = Union[random.Random, np.random.Generator]


@dataclass(frozen=True)
class DeeplabAugmentation:
    """The numbers of base.py's ``_augmentation`` (defaults: configs/voc12.yaml:11, 27)."""

    crop: int = 321
    scales: Tuple[float, ...] = (0.5, 0.75, 1.0, 1.25, 1.5)
    flip: bool = True
    base_size: Optional[int] = None
    mean_bgr: Tuple[float, float, float] = MEAN_BGR
    ignore_label: int = _IGNORE

    def __post_init__(self) -> None:
        if isinstance(self.crop, bool) or not isinstance(self.crop, int) or self.crop < 8:
            raise ValueError(f"crop must be an integer >= 8, got {self.crop!r}")
        if not self.scales or not all(isinstance(s, (int, float)) and 0 < s <= 8 for s in self.scales):
            raise ValueError(f"scales must be numbers in (0, 8], got {self.scales!r}")
        if self.base_size is not None and (not isinstance(self.base_size, int) or self.base_size < 1):
            raise ValueError(f"base_size must be None or a positive integer, got {self.base_size!r}")


def _resize_linear(img: np.ndarray, h: int, w: int) -> np.ndarray:
    """cv2.resize(img, (w, h), interpolation=cv2.INTER_LINEAR) of a float32 (H, W, C) image:
    source coordinate ``(d + 0.5) * in / out - 0.5`` in double, its floor and fraction (weights
    in float32), clamped to the edge pixels; rows then columns, in float32. Measured against
    opencv-python-headless 5.0 (not a dependency): within 3.1e-5 on 0..255 (2 float32 ulps)."""
    H, W = img.shape[:2]
    if (H, W) == (h, w):
        return img.copy()  # cv2 copies an image of the same size

    def taps(n_in: int, n_out: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        scale = 1.0 / (n_out / n_in)  # cv2: scale_x = 1. / inv_scale_x
        f = (np.arange(n_out) + 0.5) * scale - 0.5  # double, as cv2 4.x+ (a float32 fx is off by 5e-3 at 255)
        i = np.floor(f).astype(np.int64)
        f = (f - i).astype(np.float32)
        low = i < 0
        f[low], i[low] = 0, 0
        high = i >= n_in - 1
        f[high], i[high] = 0, n_in - 1
        return i, np.minimum(i + 1, n_in - 1), f

    y0, y1, fy = taps(H, h)
    x0, x1, fx = taps(W, w)
    one = np.float32(1)
    # horizontal pass on every source row, then the vertical blend (cv2's HResize, VResize)
    rows = img[:, x0] * (one - fx)[None, :, None] + img[:, x1] * fx[None, :, None]
    return (rows[y0] * (one - fy)[:, None, None] + rows[y1] * fy[:, None, None]).astype(np.float32)


def _nearest_index(n_in: int, n_out: int) -> np.ndarray:
    """PIL's NEAREST source index of each output pixel (ImagingScaleAffine): ``int(x)`` of
    ``x = 0.5 * a``, then ``x += a`` per pixel, with ``a = n_in / n_out`` in double. At exact
    ties the accumulated rounding decides, which the pixel-centre formula does not reproduce."""
    a = n_in / n_out
    steps = np.full(n_out, a)
    steps[0] = 0.5 * a
    return np.minimum(np.add.accumulate(steps).astype(np.int64), n_in - 1)


def _choice(rng: Rng, seq: Sequence[Any]) -> Any:
    return rng.choice(seq) if isinstance(rng, random.Random) else seq[int(rng.integers(len(seq)))]


def _randint(rng: Rng, hi: int) -> int:  # 0..hi inclusive, as random.randint(0, hi)
    return rng.randint(0, hi) if isinstance(rng, random.Random) else int(rng.integers(0, hi + 1))


def _random(rng: Rng) -> float:
    return rng.random()  # random.Random and np.random.Generator both have it


def _augment(rgb: np.ndarray, label: np.ndarray, aug: DeeplabAugmentation, rng: Rng) -> Tuple[np.ndarray, np.ndarray]:
    """(crop, crop, 3) float32 BGR with the mean colour in the padding, (crop, crop) int64 label."""
    if not isinstance(aug, DeeplabAugmentation):
        raise TypeError(f"params must be a DeeplabAugmentation, got {describe(aug)}")
    if not isinstance(rng, (random.Random, np.random.Generator)):
        raise TypeError(f"rng must be a random.Random or a numpy Generator, got {describe(rng)}")
    if not (isinstance(rgb, np.ndarray) and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3):
        raise ValueError(f"rgb must be a (H, W, 3) uint8 array, got {describe(rgb)}")
    if not (isinstance(label, np.ndarray) and label.shape == rgb.shape[:2]):
        raise ValueError(f"label must be an (H, W) array of the image's size {rgb.shape[:2]}, got {describe(label)}")
    image = rgb[:, :, ::-1].astype(np.float32)  # cv2.imread(...).astype(np.float32): BGR (voc.py:84)
    h, w = label.shape
    if aug.base_size:
        h, w = (aug.base_size, int(aug.base_size * w / h)) if h > w else (int(aug.base_size * h / w), aug.base_size)
    s = _choice(rng, aug.scales)
    h, w = int(h * s), int(w * s)
    image = _resize_linear(image, h, w)
    lab = np.asarray(label, dtype=np.int32)[_nearest_index(label.shape[0], h)[:, None],
                                            _nearest_index(label.shape[1], w)[None, :]].astype(np.int64)
    pad_h, pad_w = max(aug.crop - h, 0), max(aug.crop - w, 0)
    if pad_h > 0 or pad_w > 0:  # bottom and right only (base.py:78-84)
        mean = np.asarray(aug.mean_bgr, dtype=np.float32)
        padded = np.empty((h + pad_h, w + pad_w, 3), np.float32)
        padded[:] = mean
        padded[:h, :w] = image
        image = padded
        lab = np.pad(lab, ((0, pad_h), (0, pad_w)), constant_values=aug.ignore_label)
    h, w = lab.shape
    top = _randint(rng, h - aug.crop)
    left = _randint(rng, w - aug.crop)
    image = image[top:top + aug.crop, left:left + aug.crop]
    lab = lab[top:top + aug.crop, left:left + aug.crop]
    if aug.flip and _random(rng) < 0.5:
        image, lab = image[:, ::-1], lab[:, ::-1]
    return np.ascontiguousarray(image), np.ascontiguousarray(lab)


def augment_bgr(rgb: np.ndarray, label: np.ndarray, params: DeeplabAugmentation, rng: Rng
                ) -> Tuple[np.ndarray, np.ndarray]:
    """One training sample as base.py's ``__getitem__`` returns it: (H, W, 3) uint8 RGB and (H, W)
    label -> (3, crop, crop) float32 BGR minus ``params.mean_bgr`` (0 in the padding) and
    (crop, crop) int64 label (255 in the padding)."""
    image, lab = _augment(rgb, label, params, rng)
    # image -= self.mean_bgr: float32 minus float64, computed in float64, stored in float32
    image = (image.astype(np.float64) - np.asarray(params.mean_bgr, dtype=np.float64)).astype(np.float32)
    return np.ascontiguousarray(image.transpose(2, 0, 1)), lab


def augment(rgb: np.ndarray, label: np.ndarray, params: DeeplabAugmentation, rng: Rng
            ) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`augment_bgr`'s crop (the same draws) as (crop, crop, 3) uint8 RGB (rounded, the
    padding the mean colour rounded) and a (crop, crop) uint8 label: the interface of
    :func:`mars_plugin.networks.seg_data.augment`. ``normalize`` of it differs from
    :func:`augment_bgr` by the rounding to bytes (at most 0.5, and 0.008..0.33 in the padding)."""
    image, lab = _augment(rgb, label, params, rng)
    rgb_out = np.clip(np.rint(image[:, :, ::-1]), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(rgb_out), lab.astype(np.uint8)


def train_sample(rgb: np.ndarray, label: np.ndarray, params: DeeplabAugmentation, rng: Rng
                 ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One draw of the augmentation as ``mars train`` uses it: the network's input exactly as
    :func:`augment_bgr` (upstream's float crop, never rounded to bytes), the same crop as
    :func:`augment`'s uint8 RGB (what the MARS teacher's CRF compares) and the (crop, crop)
    uint8 label. Shapes: (3, crop, crop) float32, (crop, crop, 3) uint8, (crop, crop) uint8."""
    image, lab = _augment(rgb, label, params, rng)
    bgr = (image.astype(np.float64) - np.asarray(params.mean_bgr, dtype=np.float64)).astype(np.float32)
    rgb_out = np.clip(np.rint(image[:, :, ::-1]), 0, 255).astype(np.uint8)
    return (np.ascontiguousarray(bgr.transpose(2, 0, 1)), np.ascontiguousarray(rgb_out),
            np.ascontiguousarray(lab.astype(np.uint8)))


def normalize(images: Any, mean_bgr: Sequence[float] = MEAN_BGR) -> torch.Tensor:
    """(B, H, W, 3) uint8 RGB (tensor or array) -> (B, 3, H, W) float32 BGR minus ``mean_bgr``,
    no std (base.py:110: float64 arithmetic, float32 result); a tensor stays on its device."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.ndim != 4 \
            or images.shape[-1] != 3:
        raise ValueError(f"images must be uint8 RGB (B, H, W, 3), got {describe(images)}")
    x = images.flip(-1).permute(0, 3, 1, 2).to(torch.float64)
    mean = torch.tensor(tuple(mean_bgr), dtype=torch.float64, device=x.device).view(1, 3, 1, 1)
    return (x - mean).to(torch.float32).contiguous()


def _groups_of(model: nn.Module) -> Dict[str, List[nn.Parameter]]:
    # main.py get_params: walk named_modules; "layer" convs -> all their parameters (1x),
    # "aspp" convs -> weight (10x) and bias (20x). BatchNorm belongs to no group.
    out: Dict[str, List[nn.Parameter]] = {"1x": [], "10x": [], "20x": []}
    for name, m in model.named_modules():
        if not isinstance(m, nn.Conv2d):
            continue
        if "layer" in name:
            out["1x"].extend(m.parameters())
        if "aspp" in name:
            out["10x"].append(m.weight)
            out["20x"].append(m.bias)
    return out


def param_groups(model: nn.Module, lr: float, weight_decay: float) -> List[Dict[str, Any]]:
    """main.py's three SGD groups for a deeplabv2 network (plain, ``MSC``- or DDP-wrapped).

    =======  =========  ============  =====================================================
    name     lr         weight decay  parameters
    =======  =========  ============  =====================================================
    ``1x``   lr         weight_decay  every conv of the ``layer*`` modules (weights only:
                                      they have no bias)
    ``10x``  10 lr      weight_decay  the ASPP convs' weights
    ``20x``  20 lr      0             the ASPP convs' biases
    =======  =========  ============  =====================================================

    No BatchNorm parameter is in any group (upstream freezes BN and never steps it). Each group
    carries ``name`` and ``lr_mult`` for :func:`poly_lr`. Use with
    ``torch.optim.SGD(groups, lr=lr, momentum=0.9)``.
    """
    lr = check_real_param(lr, "lr", 0.0, float("inf"), low_open=True)
    weight_decay = check_real_param(weight_decay, "weight_decay", 0.0, float("inf"))
    found = _groups_of(model)
    if not found["10x"]:
        raise TypeError(f"model must be a deeplabv2 network (convs under 'layer*' and 'aspp'), got {describe(model)}")
    spec = (("1x", 1.0, weight_decay), ("10x", 10.0, weight_decay), ("20x", 20.0, 0.0))
    return [{"params": found[n], "name": n, "lr_mult": m, "lr": m * lr, "weight_decay": wd} for n, m, wd in spec]


def poly_lr(base: float, iteration: int, iter_max: int, power: float = 0.9, step_size: int = 10) -> float:
    """The lr of the optimizer step of ``iteration`` (1-based, main.py:210's counter) under
    lr_scheduler.py's ``PolynomialLR``: ``base * (1 - k / iter_max) ** power`` with k the last
    multiple of ``step_size`` before ``iteration`` (0: base) and not above ``iter_max``."""
    if isinstance(iteration, bool) or not isinstance(iteration, (int, np.integer)) or iteration < 1:
        raise ValueError(f"iteration must be an integer >= 1 (1-based), got {iteration!r}")
    if isinstance(step_size, bool) or not isinstance(step_size, (int, np.integer)) or step_size < 1:
        raise ValueError(f"step_size must be an integer >= 1, got {step_size!r}")
    k = (int(iteration) - 1) // step_size * step_size
    k = min(k, int(iter_max) // step_size * step_size)  # get_lr keeps the lr once last_epoch > iter_max
    if k == 0:
        return base
    return base * (1 - float(k) / iter_max) ** power


def resize_labels_nearest(labels: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """(B, H, W) labels -> (B, h, w) long, PIL ``NEAREST`` as main.py's ``resize_labels`` (its
    source indices, :func:`_nearest_index`; on the labels' device). ``size`` is (h, w). Floating
    maps (the MARS hook's per-pixel weights) are picked from the same pixels and keep their dtype."""
    h, w = int(size[0]), int(size[1])
    iy = torch.from_numpy(_nearest_index(int(labels.shape[-2]), h)).to(labels.device)
    ix = torch.from_numpy(_nearest_index(int(labels.shape[-1]), w)).to(labels.device)
    out = labels[..., iy[:, None], ix[None, :]]
    return out if out.is_floating_point() else out.long()


def msc_loss(outputs: Union[torch.Tensor, Iterable[torch.Tensor]], labels: torch.Tensor, iter_size: int = 1,
             ignore_index: int = _IGNORE) -> torch.Tensor:
    """main.py:228-240: the sum over the MSC outputs (each (B, L, h, w)) of the mean
    cross-entropy against the labels (B, H, W) resized to that output by PIL nearest, ignoring
    ``ignore_index``; divided by ``iter_size`` (gradients accumulated over that many batches).
    A single tensor counts as one output."""
    if isinstance(outputs, torch.Tensor):
        outputs = [outputs]
    outputs = list(outputs)
    if not outputs or not all(isinstance(t, torch.Tensor) and t.ndim == 4 for t in outputs):
        raise ValueError(f"outputs must be (B, L, h, w) logits or a list of them, got {describe(outputs)}")
    if isinstance(iter_size, bool) or not isinstance(iter_size, int) or iter_size < 1:
        raise ValueError(f"iter_size must be an integer >= 1, got {iter_size!r}")
    total = sum(F.cross_entropy(t, resize_labels_nearest(labels, tuple(t.shape[-2:])), ignore_index=ignore_index)
                for t in outputs)
    return total / iter_size


def msc_step_loss(outputs: Sequence[torch.Tensor], labels: torch.Tensor, *, hook: Any = None, images: Any = None,
                  classes: Any = None, images_rgb: Any = None, all_reduce: Any = None,
                  ignore_index: int = _IGNORE) -> torch.Tensor:
    """One batch's loss as main.py:228-236 sums it, for ``mars train`` (before ``/ iter_size``):
    the sum over the MSC outputs of the loss on that output's grid (labels resized by PIL
    nearest) divided by *that output's* count of labelled pixels (not 255; MARS's biased 254
    counted: the teacher fills them). ``--loss ce``: exactly :func:`msc_loss` with iter_size 1.
    With ``hook`` (a :class:`~mars_plugin.adapters.training_hook.MARSTrainingHook` of
    ``reduction="sum"``, ``match="labels_nearest"``, ``label_resize=resize_labels_nearest``)
    each output's summed WCE; ``images``, ``classes``, ``images_rgb`` are its arguments.
    ``all_reduce`` (in place sum over the processes, or None) makes each count global, so that
    N processes step as one process on their batches together (upstream's DataParallel mean)."""
    outputs = list(outputs)
    if hook is not None:
        sums = hook(images, outputs, labels, classes, images_rgb=images_rgb, reduce_outputs=False)
    else:
        sums = [F.cross_entropy(t.float(), resize_labels_nearest(labels, tuple(t.shape[-2:])),
                                ignore_index=ignore_index, reduction="sum") for t in outputs]
    counts = torch.stack([(resize_labels_nearest(labels, tuple(t.shape[-2:])) != ignore_index).sum()
                          for t in outputs]).double()
    if all_reduce is not None:
        counts = all_reduce(counts)
    return sum(v.float() / n.clamp_min(1).float() for v, n in zip(sums, counts))
