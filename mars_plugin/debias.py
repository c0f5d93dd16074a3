"""Generating debiased labels (MARS Sec. 3.3, Eq. 4-5).

Eq. 4: M_hat(y, x) = ReLU(max_{c in C_I} S(F[:, y, x], V^c)), the similarity of every pixel to
the closest debiased centroid among the image's classes. After refinement (dense CRF or a
threshold) it becomes the binary mask M, and Eq. 5 marks as biased (-1) every foreground pixel
of the pseudo label where M = 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F

from ._checks import (
    as_tensor,
    check_float_tensor,
    check_fraction,
    check_image_classes,
    check_label_tensor,
    describe,
)
from .crf import check_crf_params, dense_crf, image_to_hwc_uint8
from .selection import DebiasedCentroids

__all__ = ["BIASED", "DebiasResult", "debiased_similarity", "debias_labels"]

#: Label value of biased pixels in debiased labels (Eq. 5).
BIASED = -1


def _centroid_matrix(centroids: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    """(C+1, D) centroids and (C+1,) validity from a DebiasedCentroids or a plain tensor.

    For a plain tensor, a row is valid when it is not all zeros (row 0 is never used).
    """
    if isinstance(centroids, DebiasedCentroids):
        V, valid = centroids.centroids, centroids.valid.clone()
    else:
        V = as_tensor(centroids, "centroids")
        if V.ndim != 2 or V.shape[0] < 2 or not V.is_floating_point():
            raise ValueError(f"centroids must be a DebiasedCentroids or a (C+1, D) float tensor, got {describe(V)}")
        valid = V.abs().sum(1) > 0
    valid[0] = False
    return V, valid


def _prepare(features, centroids, image_classes, size: Optional[Tuple[int, int]]):
    f = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
    single = f.ndim == 3
    if single:
        f = f[None]
    V, valid = _centroid_matrix(centroids)
    if V.shape[1] != f.shape[1]:
        raise ValueError(
            f"features have D={f.shape[1]} channels but centroids have D={V.shape[1]}; "
            "use the same USS model for select_centroids and debias_labels"
        )
    C = V.shape[0] - 1
    cls = check_image_classes(image_classes, "image_classes", C, None if single else f.shape[0])
    if single:
        cls = cls[None]
    if size is not None and tuple(f.shape[-2:]) != tuple(size):
        # Eq. 4 is per label pixel: bring the embeddings to the label grid first (STEGO's own
        # bilinear, align_corners=False up-sampling of its code maps).
        f = F.interpolate(f, size=tuple(size), mode="bilinear", align_corners=False)
    return f, V.to(f.device, f.dtype), valid.to(f.device), cls.to(f.device), single


def _similarity(f: torch.Tensor, V: torch.Tensor, usable: torch.Tensor) -> torch.Tensor:
    """Eq. 4 on a batch: f (B, D, H, W), V (C+1, D), usable (B, C+1) -> (B, H, W)."""
    fn = F.normalize(f, dim=1)
    vn = F.normalize(V, dim=1)
    cos = torch.einsum("bdhw,cd->bchw", fn, vn)
    cos = cos.masked_fill(~usable[:, :, None, None], float("-inf"))
    best = cos.max(1).values
    # An image none of whose classes has a centroid has no similarity: 0 (nothing is kept).
    return torch.relu(best.nan_to_num(neginf=0.0))


def debiased_similarity(
    features: Any,
    centroids: Union[DebiasedCentroids, torch.Tensor],
    image_classes: Any,
    *,
    size: Optional[Tuple[int, int]] = None,
) -> torch.Tensor:
    """The soft debiased mask M_hat of Eq. 4.

    Shapes:
        features: (D, H, W) or (B, D, H, W) pixel embeddings.
        centroids: :class:`DebiasedCentroids` or a (C+1, D) tensor (all-zero rows = no centroid).
        image_classes: (C,) / (B, C) multi-hot tensor, or a list of 1-based class ids (a list of
            lists for a batch); see :func:`mars_plugin._checks.check_image_classes`.
        size: optional (H', W'); the embeddings are bilinearly resized to it first.

    Returns:
        (H, W) or (B, H, W) similarities in [0, 1]: ReLU of the best cosine to a debiased
        centroid of one of the image's classes that has a centroid; 0 where none has.
    """
    f, V, valid, cls, single = _prepare(features, centroids, image_classes, size)
    usable = torch.cat([torch.zeros_like(cls[:, :1]), cls], 1) & valid[None]
    m = _similarity(f, V, usable)
    return m[0] if single else m


@dataclass
class DebiasResult:
    """Everything :func:`debias_labels` computed, for reports and plots.

    Attributes:
        labels: debiased labels Y^db, (H, W) or (B, H, W) long with -1 for biased pixels.
        similarity: the soft mask M_hat (Eq. 4), same spatial shape, float.
        mask: the binary mask M after refinement, bool.
        untouched: per image, the foreground classes of the pseudo label that have no debiased
            centroid and were therefore left unchanged.
    """

    labels: torch.Tensor
    similarity: torch.Tensor
    mask: torch.Tensor
    untouched: List[List[int]]


def debias_labels(
    features: Any,
    pseudo_label: Any,
    centroids: Union[DebiasedCentroids, torch.Tensor],
    image_classes: Any,
    *,
    image: Any = None,
    refine: str = "crf",
    threshold: float = 0.5,
    ignore_index: int = 255,
    crf_params: Optional[Mapping[str, Any]] = None,
    return_details: bool = False,
) -> Union[torch.Tensor, DebiasResult]:
    """Debiased labels Y^db (Eq. 4-5): foreground pixels unlike every debiased centroid become -1.

    Shapes:
        features: (D, h, w) or (B, D, h, w) USS embeddings; resized bilinearly to the label grid
            when (h, w) differs from it.
        pseudo_label: (H, W) or (B, H, W) WSSS label, 0..C or ``ignore_index``.
        centroids: from :func:`select_centroids` (or a (C+1, D) tensor).
        image_classes: image-level labels: (C,) / (B, C) multi-hot tensor, or a list of 1-based
            class ids (list of lists for a batch).
        image: RGB image (H, W, 3) or (3, H, W), uint8 or float in [0, 1] (batch: a leading B);
            required by ``refine="crf"``.

    Args:
        refine: ``"crf"``: M = argmax of a 2-label dense CRF whose unary is -log[1 - M_hat,
            M_hat] (clipped at 1e-5); ``"threshold"``: M = M_hat > ``threshold``.
        threshold: used by ``refine="threshold"``; in [0, 1).
        crf_params: overrides of :data:`mars_plugin.crf.DEFAULT_CRF_PARAMS`.
        return_details: return a :class:`DebiasResult` (labels, M_hat, M, untouched classes)
            instead of the labels alone.

    Returns:
        Long tensor like ``pseudo_label`` where pixels with label > 0 (not ignore) and M = 0
        are -1; ignore pixels stay ignore; classes without a valid centroid stay untouched.
    """
    if refine not in ("crf", "threshold"):
        raise ValueError(f"refine must be 'crf' or 'threshold', got {refine!r}")
    threshold = check_fraction(threshold, "threshold", low_open=False)
    if threshold >= 1.0:
        raise ValueError(f"threshold must lie in [0, 1), got {threshold}")
    f_in = check_float_tensor(features, "features", (3, 4), "(D, H, W) or (B, D, H, W)")
    single = f_in.ndim == 3
    y = check_label_tensor(
        pseudo_label, "pseudo_label", (2,) if single else (3,), "(H, W)" if single else "(B, H, W)",
        ignore_index=ignore_index,
        num_classes=(centroids.num_classes if isinstance(centroids, DebiasedCentroids) else None),
    )
    yb = y[None] if single else y
    if yb.shape[0] != (1 if single else f_in.shape[0]):
        raise ValueError(f"features and pseudo_label must hold the same number of images, got {f_in.shape[0]} and {yb.shape[0]}")
    H, W = yb.shape[-2:]
    f, V, valid, cls, _ = _prepare(f_in, centroids, image_classes, (H, W))
    C = V.shape[0] - 1
    fg_vals = yb[yb != ignore_index]
    if fg_vals.numel() and int(fg_vals.max()) > C:
        raise ValueError(f"pseudo_label holds class {int(fg_vals.max())} but the centroids cover 1..{C}")
    yb = yb.to(f.device)

    usable = torch.cat([torch.zeros_like(cls[:, :1]), cls], 1) & valid[None]
    m_hat = _similarity(f, V, usable)

    if refine == "threshold":
        mask = m_hat > threshold
    else:
        if image is None:
            raise ValueError("refine='crf' needs the RGB image: pass image=..., or use refine='threshold'")
        imgs = as_tensor(image, "image")
        if not single:
            if imgs.ndim != 4 or imgs.shape[0] != yb.shape[0]:
                raise ValueError(f"image must be a batch (B, H, W, 3) or (B, 3, H, W) with B={yb.shape[0]}, got {describe(imgs)}")
        else:
            imgs = imgs[None]
        params = check_crf_params(crf_params)
        masks = []
        for b in range(yb.shape[0]):
            rgb = image_to_hwc_uint8(imgs[b], "image" if single else f"image[{b}]", (H, W))
            p = m_hat[b].detach().cpu().double().numpy()
            q = dense_crf(np.stack([1.0 - p, p]), rgb, params)
            masks.append(torch.from_numpy(q.argmax(0) == 1))
        mask = torch.stack(masks).to(yb.device)

    touched = valid.clone()
    touched[0] = False
    safe = yb.clamp(0, C).masked_fill(yb == ignore_index, 0)
    biased = (yb != ignore_index) & (yb > 0) & ~mask & touched[safe]
    out = yb.masked_fill(biased, BIASED)

    if not return_details:
        return out[0] if single else out
    untouched = []
    for b in range(yb.shape[0]):
        present = torch.unique(yb[b][(yb[b] > 0) & (yb[b] != ignore_index)]).tolist()
        untouched.append([int(c) for c in present if not bool(valid[int(c)])])
    if single:
        return DebiasResult(out[0], m_hat[0], mask[0], untouched)
    return DebiasResult(out, m_hat, mask, untouched)
