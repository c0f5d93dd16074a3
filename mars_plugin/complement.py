"""Complementing debiased labels with an EMA teacher (MARS Sec. 3.4, Eq. 6).

Biased (-1) pixels are filled with the teacher's label Y^te (argmax over the background and the
image's classes, optionally after a dense CRF), and the certainty mask W (Eq. 6) is the teacher's
highest foreground probability among the image's classes on those pixels, 1 elsewhere.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Tuple, Union

import torch

from ._checks import as_tensor, check_finite, check_image_classes, check_label_tensor, check_ndim, describe
from .crf import check_crf_backend, check_crf_params, dense_crf
from .debias import BIASED
from .local_crf import check_local_crf_params, local_crf

__all__ = ["complement_labels", "teacher_labels"]


def _prepare(debiased, teacher_probs, image_classes, ignore_index):
    p = as_tensor(teacher_probs, "teacher_probs")
    check_ndim(p, "teacher_probs", (3, 4), "(C+1, H, W) or (B, C+1, H, W)")
    if not p.is_floating_point():
        raise TypeError(f"teacher_probs must be floating softmax probabilities, got {describe(p)}")
    single = p.ndim == 3
    if single:
        p = p[None]
    if p.shape[1] < 2:
        raise ValueError(f"teacher_probs needs background + at least one class (C+1 >= 2 channels), got {describe(p)}")
    p = p.detach()
    check_finite(p, "teacher_probs")
    if float(p.min()) < 0 or float(p.max()) > 1:
        raise ValueError(
            f"teacher_probs must be probabilities in [0, 1] (apply .softmax(1) to the teacher's logits), "
            f"got values in [{float(p.min()):.4g}, {float(p.max()):.4g}]"
        )
    C = p.shape[1] - 1
    y = check_label_tensor(
        debiased, "debiased", (2,) if single else (3,), "(H, W)" if single else "(B, H, W)",
        ignore_index=ignore_index, allow_biased=True, num_classes=C,
    )
    if single:
        y = y[None]
    if tuple(y.shape) != (p.shape[0],) + tuple(p.shape[2:]):
        raise ValueError(
            f"debiased must have shape (B, H, W) = {(p.shape[0],) + tuple(p.shape[2:])} to match teacher_probs, "
            f"got {tuple(y.shape)}"
        )
    cls = check_image_classes(image_classes, "image_classes", C, None if single else p.shape[0])
    if single:
        cls = cls[None]
    return y.to(p.device), p, cls.to(p.device), single


def teacher_labels(
    teacher_probs: torch.Tensor,
    allowed: torch.Tensor,
    *,
    refine: Optional[str] = None,
    image: Any = None,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
) -> torch.Tensor:
    """Teacher label Y^te: argmax of (B, C+1, H, W) probabilities over the ``allowed`` (B, C+1)
    channels (background + the image's classes), after the dense CRF of
    :func:`mars_plugin.crf.dense_crf` when ``refine="crf"`` (the whole batch at once on the
    probabilities' device), or the windowed approximation of
    :func:`mars_plugin.local_crf.local_crf` when ``refine="local_crf"`` (``crf_params`` then
    also takes ``window`` and ``scale``).

    The CRF sees only the allowed channels, renormalised to sum to 1, as the WSSS repositories
    do with image-level labels: each image's allowed channels are gathered to the front, so a
    batch of VOC images (a few classes each) is refined over a few labels, not 21.
    """
    masked = teacher_probs.masked_fill(~allowed[:, :, None, None], float("-inf"))
    if refine is None:
        return masked.argmax(1)
    if refine not in ("crf", "local_crf"):
        raise ValueError(f"refine must be None, 'crf' or 'local_crf', got {refine!r}")
    params = check_crf_params(crf_params) if refine == "crf" else check_local_crf_params(crf_params)
    if image is None:
        raise ValueError(f"refine={refine!r} needs the RGB images: pass image=(B, H, W, 3) or (B, 3, H, W)")
    imgs = as_tensor(image, "image")
    if imgs.ndim == 3:
        imgs = imgs[None]
    B, _, H, W = teacher_probs.shape
    if imgs.ndim != 4 or imgs.shape[0] != B:
        raise ValueError(f"image must hold B={B} RGB images, got {describe(imgs)}")
    n_allowed = allowed.sum(1)
    order = torch.sort((~allowed).to(torch.int8), dim=1, stable=True).indices[:, : int(n_allowed.max())]
    ok = torch.arange(order.shape[1], device=allowed.device)[None, :] < n_allowed[:, None]
    # float64 before the renormalisation and the clip, as these probabilities reached pydensecrf.
    p = teacher_probs.detach().double().gather(1, order[:, :, None, None].expand(-1, -1, H, W))
    p = p.masked_fill(~ok[:, :, None, None], 0)
    p = p / p.sum(1, keepdim=True).clamp_min(1e-12)
    if refine == "local_crf":
        q = local_crf(p.float(), imgs, params, valid=ok)
    else:
        q = dense_crf(p, imgs, params, valid=ok, backend=crf_backend)
    return order.gather(1, q.argmax(1).flatten(1).to(order.device)).view(B, H, W)


def complement_labels(
    debiased: Any,
    teacher_probs: Any,
    image_classes: Any,
    *,
    refine: Optional[str] = None,
    image: Any = None,
    ignore_index: int = 255,
    crf_params: Union[None, str, Mapping[str, Any]] = None,
    crf_backend: str = "torch",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fill biased pixels with the teacher's label and weigh them by its certainty (Eq. 6).

    Shapes:
        debiased: (H, W) or (B, H, W) debiased labels Y^db with -1 = biased, 255 = ignore.
        teacher_probs: (C+1, H, W) or (B, C+1, H, W) softmax of the EMA teacher (no grad needed).
        image_classes: (C,) / (B, C) multi-hot, or 1-based class-id lists.
        refine: None (argmax), ``"crf"`` (the dense CRF over the image's classes, batched on
            the probabilities' device; :func:`mars_plugin.crf.dense_crf`) or ``"local_crf"``
            (its windowed approximation, :mod:`mars_plugin.local_crf`).
        image: RGB images for ``refine="crf"|"local_crf"``, (B, H, W, 3) or (B, 3, H, W), uint8
            or [0, 1].
        crf_params: a preset name (``"mars"`` default, ``"psa"``) or a dict of overrides.
        crf_backend: ``"torch"`` or ``"pydensecrf"`` (the reference; CPU, per image).

    Returns:
        ``(complemented, certainty)``: complemented labels Y^co (long, -1 replaced by Y^te,
        everything else unchanged) and W (float, same shape): the max over the image's
        foreground classes of ``teacher_probs`` where Y^db = -1 (0 for an image with no
        foreground class), 1 elsewhere. Both carry no gradient.
    """
    check_crf_backend(crf_backend)
    y, p, cls, single = _prepare(debiased, teacher_probs, image_classes, ignore_index)
    allowed = torch.cat([torch.ones_like(cls[:, :1]), cls], 1)
    biased = y == BIASED
    y_te = teacher_labels(p, allowed, refine=refine, image=image, crf_params=crf_params, crf_backend=crf_backend)
    complemented = torch.where(biased, y_te, y)
    fg = p[:, 1:].masked_fill(~cls[:, :, None, None], float("-inf")).max(1).values
    fg = fg.nan_to_num(neginf=0.0).clamp_min(0.0)
    certainty = torch.where(biased, fg, torch.ones_like(fg))
    if single:
        return complemented[0], certainty[0]
    return complemented, certainty
