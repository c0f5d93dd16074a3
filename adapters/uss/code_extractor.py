"""What the ViT-based USS extractors share: the input size, the output grid, and ``forward``
(resize, normalise, one scale with or without the flip or DHR's multi-scale inference, the
final resize and L2 normalisation), plus the weights-only file reader of DHR's files.

:class:`~mars_plugin.adapters.uss.stego.STEGOExtractor`,
:class:`~mars_plugin.adapters.uss.dinov2.DINOv2Extractor` and
:class:`~mars_plugin.adapters.uss.cause.CAUSEExtractor` differ only in their ``code`` (what one
normalised batch becomes) and their files; the rest is here, once.
"""
from __future__ import annotations

import math
import os
from typing import Any, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from mars_plugin._checks import MAX_RES, check_scales

from mars_plugin.adapters.uss.multiscale import check_scaled_tokens, multiscale_batch, nearest_patch_size, scaled_size
from mars_plugin.adapters.uss.preprocess import (
    INTERPOLATIONS,
    as_float_images,
    check_output_size,
    normalize_imagenet,
    resize_features,
    resize_images,
)
from mars_plugin.adapters.uss.vit import MAX_TOKENS
from mars_plugin.adapters.uss.vit_weights import load_checkpoint

__all__ = ["CodeExtractor", "stego_input_size", "load_tensor_file", "what_is"]

PathLike = Union[str, os.PathLike]


def stego_input_size(height: int, width: int, res: int, patch: int) -> Tuple[int, int]:
    """The network input size for an image: shorter side ~ ``res``, both sides multiples of ``patch``.

    Each side becomes ``floor(side * res / min(H, W) / patch + 0.5) * patch`` (at least one patch).
    """
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    s = res / min(height, width)

    def side(n: int) -> int:
        return max(patch, int(math.floor(n * s / patch + 0.5)) * patch)

    return side(height), side(width)


def load_tensor_file(path: PathLike, what: str) -> Any:
    """``torch.load(path, map_location="cpu", weights_only=True)`` (DHR's and CAUSE's files); a
    file that needs unpickling is a PermissionError naming the objects it holds (found by torch's
    scanner, never run)."""
    try:
        return load_checkpoint(path, trust_pickle=False, what=what)
    except PermissionError:
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(os.fspath(path))
        except Exception:  # noqa: BLE001 - an old pickle protocol the scanner cannot read
            found = ["objects in an old pickle protocol"]
        raise PermissionError(
            f"{os.fspath(path)}: this {what} holds pickled Python objects ({', '.join(found[:6])}), not only "
            f"tensors; DHR's and CAUSE's weight files are plain state dicts, and they are only read with "
            f"torch.load(weights_only=True), so this file is refused and nothing in it was run"
        ) from None


def what_is(obj: Any) -> str:
    """'a dict with keys [...]', 'a list', ...: what a file held, for error messages."""
    return f"a {type(obj).__name__}" + (f" with keys {sorted(map(str, obj))[:8]}" if isinstance(obj, Mapping) else "")


class CodeExtractor(nn.Module):
    """Base of the ViT-based extractors: (B, 3, H, W) images -> (B, D, h, w) embeddings.

    A subclass defines ``code(x)`` (a normalised (B, 3, H', W') batch, sides multiples of the
    patch -> (B, D, H'/patch, W'/patch)) and ``patch_size``, and sets ``res`` (None: the image's
    own resolution), ``scales`` (None: one scale), ``flip_average``, ``normalize`` and
    ``interpolation``.

    ``max_tokens`` (default :data:`~mars_plugin.adapters.uss.vit.MAX_TOKENS`, 65,536; set it on the
    instance to change it) bounds the patch tokens of every network input:
    :meth:`check_input_size` refuses a larger one before any work, naming the image size, the
    input it would build and the bound (``mars features`` reports it per file).
    """

    max_tokens: int = MAX_TOKENS
    res: Optional[int]
    scales: Optional[Tuple[float, ...]]
    flip_average: bool
    normalize: bool
    interpolation: str

    @property
    def patch_size(self) -> int:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def code(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def _set_inputs(self, patch: int, *, res: Optional[int], flip_average: bool, normalize: bool,
                    interpolation: str, scales: Optional[Sequence[float]]) -> None:
        """Check and set the input settings (once, for every subclass)."""
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        if res is not None and (isinstance(res, bool) or not isinstance(res, int) or not patch <= res <= MAX_RES):
            raise ValueError(f"res must be None (the image's own resolution) or an integer in {patch}..{MAX_RES} "
                             f"(from the patch size {patch}), got {res!r}")
        self.res = res
        self.flip_average = bool(flip_average)
        self.normalize = bool(normalize)
        self.interpolation = interpolation
        self.scales = None if scales is None else check_scales(scales)

    def _check_patch_multiple(self, x: torch.Tensor) -> None:
        """``code``'s input check: sides that are multiples of the patch (the ViT cuts patches)."""
        p = self.patch_size
        if x.shape[-2] % p or x.shape[-1] % p:
            raise ValueError(f"image sides must be multiples of the patch {p}, got {tuple(x.shape[-2:])}")

    def settings_text(self) -> str:
        """The input settings, as ``describe()`` ends."""
        size = "full resolution" if self.res is None else f"shorter side {self.res}, {self.interpolation} resize"
        scales = "" if self.scales is None else f"scales {', '.join(f'{s:g}' for s in self.scales)}, "
        return (f"{size}, {scales}flip averaging {'on' if self.flip_average else 'off'}, "
                f"L2 normalisation {'on' if self.normalize else 'off'}")

    def input_size(self, height: int, width: int) -> Tuple[int, int]:
        """Base input size for an image of ``height`` x ``width``: :func:`stego_input_size` at
        ``res``; with ``res=None`` the image's own size (with ``scales``: DHR resizes nothing
        before its inference) or each side rounded to the nearest patch multiple (one scale)."""
        if self.res is not None:
            return stego_input_size(height, width, self.res, self.patch_size)
        if self.scales is not None:
            return height, width
        return nearest_patch_size(height, width, self.patch_size)

    def check_input_size(self, height: int, width: int) -> None:
        """Refuse (ValueError) an image whose network input, at any scale, would hold more than
        ``max_tokens`` patch tokens: the ``res`` rule on an image of extreme aspect ratio (the
        shorter side goes to ``res``, the longer one follows), or a large image at its own
        resolution or at DHR's scale 2.0. Also refuses what :meth:`input_size` and
        :func:`~mars_plugin.adapters.uss.multiscale.scaled_size` refuse (a side below a pixel)."""
        p = self.patch_size
        h, w = self.input_size(height, width)
        if self.scales is not None:
            try:
                check_scaled_tokens(h, w, self.scales, p, self.max_tokens)
            except ValueError as e:
                base = "" if (h, w) == (height, width) else f" (the {h}x{w} base input of a {height}x{width} image)"
                raise ValueError(f"{e}{base}") from None
            return
        tokens = (h // p) * (w // p)
        if tokens > self.max_tokens:
            why = (f"res={self.res} brings the shorter side to about {self.res} and the longer one follows"
                   if self.res is not None else "the image's own resolution")
            raise ValueError(f"an image of {height}x{width} would reach the network as a {h}x{w} input, {tokens:,} "
                             f"patch tokens of {p} pixels ({why}), more than max_tokens = {self.max_tokens:,}; crop "
                             "or downscale the image" + (", or use a smaller res" if self.res is not None else ""))

    def grid_size(self, height: int, width: int) -> Tuple[int, int]:
        """(h, w) of the output for an image of ``height`` x ``width`` with ``output_size=None``
        (with ``scales``: the grid of the first scale)."""
        h, w = self.input_size(height, width)
        if self.scales is not None:
            h, w = scaled_size(h, w, self.scales[0], self.patch_size)
        return h // self.patch_size, w // self.patch_size

    @torch.no_grad()
    def forward(self, images: torch.Tensor, output_size: Optional[Tuple[int, int]] = None) -> torch.Tensor:
        """(B, 3, H, W) uint8 or float [0, 1] RGB -> (B, D, h, w) float32.

        The image size is checked first (:meth:`check_input_size`: at most ``max_tokens`` patch
        tokens per input). The images are resized to :meth:`input_size` (``interpolation``) and
        ImageNet-normalised;
        then one scale (with ``flip_average``, the mean of the code of the image and of its
        flip, flipped back: STEGO's evaluation, ``src/eval_segmentation.py:124-128``) or, with
        ``scales``, :func:`~mars_plugin.adapters.uss.multiscale.multiscale_batch` of :meth:`code`
        (DHR's ``inference``, ``core/uss/__init__.py:54-74``, per image; one :meth:`code` call per
        scale for the whole batch and its mirrors). (h, w) is
        :meth:`grid_size`, or ``output_size`` (bilinear, align_corners=False); ``normalize``
        L2-normalises each pixel's vector after that resize.
        """
        output_size = check_output_size(output_size)
        x = as_float_images(images)
        self.check_input_size(*x.shape[-2:])
        x = normalize_imagenet(resize_images(x, self.input_size(*x.shape[-2:]), self.interpolation))
        if self.scales is not None:
            # one call of the network per scale for the whole batch (images and mirrors together)
            f = multiscale_batch(self.code, x, self.scales, self.flip_average, self.patch_size, self.max_tokens)
        elif self.flip_average:
            c, c_flip = self.code(torch.cat([x, x.flip(3)], dim=0)).float().chunk(2, dim=0)
            f = (c + c_flip.flip(3)) / 2
        else:
            f = self.code(x).float()
        f = resize_features(f, output_size)
        if self.normalize:
            f = F.normalize(f, dim=1)
        return f
