"""Multi-scale, flip-averaged feature inference as DHR computes its USS features.

DHR (Jo et al., the MARS authors' follow-up; shjo-april/DHR @ 94d5189) writes the STEGO / CAUSE
features it trains with through ``inference`` (``core/uss/__init__.py:10-74``, the branch without
``mode='sliding'``, l. 54-68). Read from that code:

* the image arrives normalised at its full resolution: ``produce_uss_features.py:17,32`` apply
  ``T.Compose([T.Normalize(), T.ToTensor()])`` to the PIL image, and ``Normalize``
  (``tools/transforms.py:235-254``) computes ``(x / 255 - mean) / std`` per channel in float32
  with the ImageNet statistics (l. 10-11);
* for each scale of ``scales=[2.0, 1.0, 1.5, 0.5]`` (l. 11), in that order: ``sh, sw =
  int(ih * scale), int(iw * scale)``, each raised one by one to the next multiple of the patch
  (l. 56-58), i.e. rounded *up*;
* ``resize(image[None], (sh, sw))`` (l. 60): ``core/uss/utils.py:10-27``, ``F.interpolate(...,
  mode='bilinear', align_corners=False)``, skipped when the size is unchanged (utils l. 23);
* with ``hflip`` the flipped copy joins the same batch (l. 61), the model runs once on the batch
  of 2 (l. 63), the second map is flipped back (l. 65-66) and the two are averaged
  (``feat.mean(dim=0)``, l. 68);
* the first scale's map starts the sum; every later one is resized to the first one's grid with
  the same ``resize`` (bilinear, align_corners False, skipped when equal) and added (l. 71-72);
* the sum is divided by the number of scales (l. 74).

:func:`multiscale` does exactly this, in the same order, for any ``fn`` that maps a normalised
(B, 3, H, W) batch to (B, D, H/patch, W/patch); :func:`multiscale_batch` does it for a batch of
same-size images with one ``fn`` call per scale (the images and their mirrors together), which
the extractors (STEGO, Leopart, DINOv2, CAUSE, ModelExtractor) call when given ``scales``.
DHR's saved features are not L2-normalised (``produce_uss_features.py:33-34`` saves
``inference``'s output as is).
"""
from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from mars_plugin._checks import check_int_param, check_scales, describe

from mars_plugin.adapters.uss.vit import MAX_TOKENS

__all__ = ["DHR_SCALES", "DHR_SETTINGS", "multiscale", "multiscale_batch", "scaled_size", "nearest_patch_size",
           "check_scaled_tokens"]

#: DHR's scales, in DHR's order (``core/uss/__init__.py:11``): the first, 2.0, sets the output grid.
DHR_SCALES: Tuple[float, ...] = (2.0, 1.0, 1.5, 0.5)

#: The extractor settings that reproduce DHR's saved USS features (one place for the reproduction
#: kit and ``mars features --dhr``): the full-resolution image (``res=None``; DHR resizes nothing
#: before ``inference``, ``produce_uss_features.py:32-33``), DHR's scales, flip averaging, no L2
#: normalisation. ``STEGOExtractor.from_files(backbone, heads, **DHR_SETTINGS)`` equals DHR's
#: ``inference(STEGO, Normalize(image))``.
DHR_SETTINGS: Mapping[str, Any] = MappingProxyType(
    {"res": None, "scales": DHR_SCALES, "flip_average": True, "normalize": False}
)


def scaled_size(height: int, width: int, scale: float, patch: int) -> Tuple[int, int]:
    """DHR's input size at one scale: ``int(side * scale)`` rounded up to a multiple of ``patch``.

    ``core/uss/__init__.py:56-58`` truncates the product, then adds 1 until the side divides by
    the patch: the ceiling to the next multiple. A side that truncates to 0 (a tiny image at a
    small scale) would make DHR's ``F.interpolate`` fail; here it is a ValueError naming it.
    """
    sizes = []
    for what, n in (("height", height), ("width", width)):
        s = int(n * scale)  # Python float product then truncation, exactly DHR's expression
        if s < 1:
            raise ValueError(
                f"scale {scale} turns the image {what} {n} into {n * scale:g} pixels, less than one; "
                f"the image is too small for this scale"
            )
        sizes.append(-(-s // patch) * patch)
    return sizes[0], sizes[1]


def check_scaled_tokens(height: int, width: int, scales: Sequence[float], patch: int,
                        max_tokens: Optional[int] = None) -> List[Tuple[int, int]]:
    """The input size of each scale (:func:`scaled_size`) for a ``height`` x ``width`` image,
    each of at most ``max_tokens`` patches (None: :data:`~mars_plugin.adapters.uss.vit.MAX_TOKENS`),
    else a ValueError naming the image size, the input it would build and the bound."""
    limit = MAX_TOKENS if max_tokens is None else int(max_tokens)
    sizes = [scaled_size(height, width, s, patch) for s in scales]
    for s, (sh, sw) in zip(scales, sizes):
        tokens = (sh // patch) * (sw // patch)
        if tokens > limit:
            raise ValueError(f"scale {s:g} turns the {height}x{width} image into a {sh}x{sw} input, {tokens:,} patch "
                             f"tokens of {patch} pixels, more than max_tokens = {limit:,}; downscale or crop the image")
    return sizes


def nearest_patch_size(height: int, width: int, patch: int) -> Tuple[int, int]:
    """Each side rounded to the nearest multiple of ``patch`` (at least one patch): the input size
    of the single-scale extractors at the image's own resolution (``res=None``)."""
    return tuple(max(patch, int(math.floor(n / patch + 0.5)) * patch) for n in (height, width))  # type: ignore


def _resize(x: torch.Tensor, size: Tuple[int, int]) -> torch.Tensor:
    """DHR's ``resize`` (``core/uss/utils.py:10-27``) on a (B, C, h, w) tensor: bilinear,
    align_corners False, and no interpolation at all when the size is already right."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=False)


@torch.no_grad()
def multiscale(
    fn: Callable[[torch.Tensor], torch.Tensor],
    image: torch.Tensor,
    scales: Sequence[float] = DHR_SCALES,
    flip: bool = True,
    patch: int = 8,
    max_tokens: Optional[int] = None,
) -> torch.Tensor:
    """DHR's multi-scale, flip-averaged features of one image (``core/uss/__init__.py:54-74``).

    Shapes: ``image`` (3, H, W) already normalised (ImageNet mean/std on [0, 1] RGB, at the
    resolution the scales apply to); ``fn`` maps a normalised (B, 3, H', W') batch, both sides
    multiples of ``patch``, to (B, D, H'/patch, W'/patch); returns (D, h, w) float32 where
    (h, w) is the first scale's grid, ``scaled_size(H, W, scales[0], patch) / patch``.

    Per scale: resize to :func:`scaled_size` (bilinear, skipped when unchanged), run ``fn`` on
    the image and, with ``flip``, its horizontal flip in the same batch of 2, flip that map back
    and average the two; resize the result to the first scale's grid (bilinear, skipped when
    equal) and add it to the sum. Returns the sum divided by ``len(scales)``. The operations run
    in DHR's order, so with the same ``fn`` the result matches DHR's to float32 rounding.
    Every scale's input is checked first: more than ``max_tokens`` patches (default
    :data:`~mars_plugin.adapters.uss.vit.MAX_TOKENS`) is a ValueError naming the sizes, before any
    work.
    ``fn``'s output is cast to float32 before it is averaged and summed (a no-op in float32; under
    float16 autocast it keeps the sum in float32). :func:`multiscale_batch` is the same for a
    batch of same-size images, one ``fn`` call per scale for all of them.
    """
    if not isinstance(image, torch.Tensor):
        raise TypeError(f"image must be a (3, H, W) float tensor, got {describe(image)}")
    if image.ndim != 3 or image.shape[0] != 3 or image.shape[1] < 1 or image.shape[2] < 1:
        raise ValueError(f"image must be one normalised (3, H, W) RGB image, got shape {tuple(image.shape)}")
    return multiscale_batch(fn, image[None], scales, flip, patch, max_tokens)[0]


@torch.no_grad()
def multiscale_batch(
    fn: Callable[[torch.Tensor], torch.Tensor],
    images: torch.Tensor,
    scales: Sequence[float] = DHR_SCALES,
    flip: bool = True,
    patch: int = 8,
    max_tokens: Optional[int] = None,
) -> torch.Tensor:
    """:func:`multiscale` of every image of a batch of same-size images, one ``fn`` call per scale.

    Shapes: ``images`` (B, 3, H, W) normalised; returns (B, D, h, w) float32, image ``i``'s map
    equal to ``multiscale(fn, images[i], ...)`` up to the rounding of ``fn`` on a larger batch
    (a ViT's matrix products tile differently; 1e-6 in float32 on a CPU).

    Why batched: ``mars features`` groups same-size images (most of VOC is 500x375), and a GPU
    runs one ViT forward of 2B images far faster than B forwards of 2. Per scale the B resized
    images and, with ``flip``, their B mirrors go through ``fn`` as one batch of 2B (images
    first, mirrors after: with B = 1 exactly DHR's batch of 2); everything after ``fn`` (flip
    back, average, resize to the first grid, sum) is elementwise per image, in DHR's order.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable (a batch of images -> (B, D, h, w)), got {describe(fn)}")
    if not isinstance(images, torch.Tensor):
        raise TypeError(f"images must be a (B, 3, H, W) float tensor, got {describe(images)}")
    if images.ndim != 4 or images.shape[0] < 1 or images.shape[1] != 3 or images.shape[2] < 1 or images.shape[3] < 1:
        raise ValueError(f"images must be a normalised (B, 3, H, W) RGB batch, got shape {tuple(images.shape)}")
    if not images.is_floating_point():
        raise TypeError(f"images must be a floating tensor (normalised RGB), got dtype {images.dtype}")
    scales = check_scales(scales)
    if not isinstance(flip, bool):
        raise TypeError(f"flip must be True or False, got {describe(flip)}")
    patch = check_int_param(patch, "patch", 1)

    B, ih, iw = int(images.shape[0]), int(images.shape[2]), int(images.shape[3])
    sizes = check_scaled_tokens(ih, iw, scales, patch, max_tokens)
    total = None
    for scale, (sh, sw) in zip(scales, sizes):
        x = _resize(images, (sh, sw))
        if flip:
            x = torch.cat([x, x.flip(-1)], dim=0)
        feat = fn(x)
        _check_output(feat, x, patch, scale, None if total is None else int(total.shape[1]))
        feat = feat.float()
        if flip:  # DHR l. 65-68: stack(map, flipped-back mirror).mean(0), without writing into fn's output
            feat = torch.stack([feat[:B], feat[B:].flip(-1)]).mean(dim=0)
        total = feat if total is None else total + _resize(feat, tuple(total.shape[2:]))
    return total / len(scales)


def _check_output(feat: Any, x: torch.Tensor, patch: int, scale: float, dim: Any) -> None:
    want = (x.shape[0], x.shape[2] // patch, x.shape[3] // patch)
    if not isinstance(feat, torch.Tensor) or feat.ndim != 4:
        raise ValueError(
            f"fn must return a (B, D, h, w) tensor; at scale {scale} it returned {describe(feat)} for a "
            f"{tuple(x.shape)} batch"
        )
    if (feat.shape[0], feat.shape[2], feat.shape[3]) != want:
        raise ValueError(
            f"fn returned a {tuple(feat.shape)} map for a {tuple(x.shape)} batch at scale {scale}; expected "
            f"({want[0]}, D, {want[1]}, {want[2]}), the {patch}-pixel patch grid (is patch={patch} the model's patch?)"
        )
    if dim is not None and feat.shape[1] != dim:
        raise ValueError(f"fn returned {feat.shape[1]} channels at scale {scale} but {dim} at the first scale")
