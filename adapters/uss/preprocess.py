"""Image preprocessing the USS extractors share: RGB checks, PIL-like resizing, ImageNet
normalisation, and the bilinear resize of feature maps to an output size."""
from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "INTERPOLATIONS",
    "as_float_images",
    "resize_images",
    "normalize_imagenet",
    "check_output_size",
    "resize_features",
]

#: ImageNet normalisation used by STEGO (``src/utils.py:140``) and Leopart's evaluation.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

INTERPOLATIONS = ("nearest", "bilinear")


def as_float_images(images: Any, name: str = "images") -> torch.Tensor:
    """(B, 3, H, W) float RGB in [0, 1]: uint8 is divided by 255, floats must already be in [0, 1]."""
    if not isinstance(images, torch.Tensor):
        import numpy as np

        if isinstance(images, np.ndarray):
            images = torch.from_numpy(np.ascontiguousarray(images))
        else:
            raise TypeError(f"{name} must be a (B, 3, H, W) tensor, got {type(images).__name__}")
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"{name} must be (B, 3, H, W) RGB, got shape {tuple(images.shape)}")
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    if not images.is_floating_point():
        raise TypeError(f"{name} must be uint8 (0..255) or float (0..1), got dtype {images.dtype}")
    x = images.float()
    if x.numel():
        lo, hi = float(x.min()), float(x.max())
        if not (math.isfinite(lo) and math.isfinite(hi)) or lo < -1e-3 or hi > 1 + 1e-3:
            raise ValueError(
                f"float {name} must be RGB in [0, 1] (pass uint8 for 0..255), got values in [{lo:.4g}, {hi:.4g}]"
            )
    return x


def resize_images(x: torch.Tensor, size: Tuple[int, int], interpolation: str) -> torch.Tensor:
    """Resize float images like PIL does: ``nearest`` picks the pixel whose centre is nearest
    (PIL ``Image.NEAREST`` = torch ``nearest-exact``); ``bilinear`` is antialiased when shrinking
    (PIL ``Image.BILINEAR``, torchvision's ``Resize`` on PIL images)."""
    size = (int(size[0]), int(size[1]))
    if tuple(x.shape[-2:]) == size:
        return x
    if interpolation == "nearest":
        return F.interpolate(x, size=size, mode="nearest-exact")
    if interpolation == "bilinear":
        return F.interpolate(x, size=size, mode="bilinear", align_corners=False, antialias=True)
    raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")


def normalize_imagenet(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std with the ImageNet statistics, per channel."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)
    return (x - mean) / std


def check_output_size(output_size: Any) -> Optional[Tuple[int, int]]:
    """None or a (h, w) pair of positive ints."""
    if output_size is None:
        return None
    try:
        h, w = output_size
        h, w = int(h), int(w)
    except (TypeError, ValueError):
        raise TypeError(f"output_size must be None or an (h, w) pair of ints, got {output_size!r}") from None
    if h < 1 or w < 1:
        raise ValueError(f"output_size must be positive, got {(h, w)}")
    return h, w


def resize_features(f: torch.Tensor, output_size: Optional[Tuple[int, int]]) -> torch.Tensor:
    """Bilinear (align_corners=False) resize of (B, D, h, w) features, as STEGO up-samples its code
    (``src/eval_segmentation.py:128``); float32 out."""
    f = f.float()
    if output_size is None or tuple(f.shape[-2:]) == tuple(output_size):
        return f
    return F.interpolate(f, size=tuple(output_size), mode="bilinear", align_corners=False)
