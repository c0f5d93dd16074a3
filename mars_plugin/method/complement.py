"""Complementing debiased labels with an EMA teacher (MARS Sec. 3.4, Eq. 6).

Biased (-1) pixels are filled with the teacher's label Y^te (argmax over the background and the
image's classes, optionally after a dense CRF), and the certainty mask W (Eq. 6) is the teacher's
highest foreground probability among the image's classes on those pixels, 1 elsewhere.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional, Tuple, Union

import numpy as np

import torch

from mars_plugin._checks import RESERVED_REASON, MAX_NUM_CLASSES, as_tensor, check_finite, check_image_classes, check_label_tensor, check_ndim, describe
from mars_plugin.engines.crf import dense_crf
from mars_plugin.engines.crf_params import check_crf_backend, check_crf_params
from mars_plugin.method.debias import BIASED
from mars_plugin.engines.local_crf import check_local_crf_params, local_crf

__all__ = ["complement_labels", "teacher_labels"]


def _is_id_list(x: Any) -> bool:
    """A flat Python list of class ids (one image), as opposed to a list of per-image lists."""
    return isinstance(x, (list, tuple, set, frozenset)) and all(
        isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in x
    )


def _prepare(debiased, teacher_probs, image_classes, ignore_index):
    """Checked (B, H, W) labels, (B, C+1, H, W) probabilities, (B, C) classes, and whether the
    caller gave one (H, W) label (the result then has that shape too).

    One image may come in the shapes a training loop has at hand: an (H, W) label with the
    teacher's (1, C+1, H, W) output of a batch of one, a (C,) multi-hot or a flat id list with
    any of them. A batch of B > 1 needs a label and a class row per image.
    """
    p = as_tensor(teacher_probs, "teacher_probs")
    check_ndim(p, "teacher_probs", (3, 4), "(C+1, H, W) or (B, C+1, H, W)")
    if not p.is_floating_point():
        raise TypeError(f"teacher_probs must be floating softmax probabilities, got {describe(p)}")
    if p.ndim == 3:
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
    B, C = p.shape[0], p.shape[1] - 1
    if C > MAX_NUM_CLASSES:
        raise ValueError(f"teacher_probs has {C + 1} channels = background + C = {C} classes, but {RESERVED_REASON}")
    y = check_label_tensor(
        debiased, "debiased", (2, 3), "(H, W) or (B, H, W)",
        ignore_index=ignore_index, allow_biased=True, num_classes=C,
    )
    single = y.ndim == 2
    if single:
        y = y[None]
    if y.shape[0] != B:
        raise ValueError(
            f"debiased holds {y.shape[0]} label(s) {tuple(np.shape(debiased))} but teacher_probs holds {B} "
            f"image(s) {tuple(np.shape(teacher_probs))}; expected one label per image"
        )
    if tuple(y.shape[1:]) != tuple(p.shape[2:]):
        H, W = y.shape[1:]
        raise ValueError(
            f"debiased {tuple(np.shape(debiased))} and teacher_probs {tuple(np.shape(teacher_probs))} must have "
            f"the same height and width; resize the teacher's logits to the labels first: "
            f"F.interpolate(logits, size=({H}, {W}), mode='bilinear', align_corners=False).softmax(1)"
        )
    one_row = B == 1 and (
        (isinstance(image_classes, (torch.Tensor, np.ndarray)) and np.ndim(image_classes) == 1)
        or _is_id_list(image_classes)
    )
    cls = check_image_classes(image_classes, "image_classes", C, None if one_row else B)
    if one_row:
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
    needed: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Teacher label Y^te: argmax of (B, C+1, H, W) probabilities over the ``allowed`` (B, C+1)
    channels (background + the image's classes), after the dense CRF of
    :func:`mars_plugin.engines.crf.dense_crf` when ``refine="crf"`` (the whole batch at once on the
    probabilities' device), or the windowed approximation of
    :func:`mars_plugin.engines.local_crf.local_crf` when ``refine="local_crf"`` (``crf_params`` then
    also takes ``window`` and ``scale``).

    The CRF sees only the allowed channels, renormalised to sum to 1, as the WSSS repositories
    do with image-level labels: each image's allowed channels are gathered to the front, so a
    batch of VOC images (a few classes each) is refined over a few labels, not 21.

    ``needed`` ((B,) bool, optional): the images whose labels the caller will use. The
    refinement runs on those alone; the others get the plain argmax (their refined labels would
    be thrown away). Each image's CRF is independent of the others in its batch, so the labels
    of the needed images are the same either way. An image with a single allowed channel is
    never refined: the CRF over one label gives that label everywhere, as the argmax does.
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
    # The CRF is most of a MARS step's teacher (GPU profile, docs/benchmarks.md): only the images
    # whose refined labels are used, and that have two labels or more to choose from, run it.
    run = n_allowed > 1
    if needed is not None:
        if needed.shape != (B,) or needed.dtype != torch.bool:
            raise ValueError(f"needed must be a (B,) = ({B},) bool tensor, got {describe(needed)}")
        run &= needed.to(run.device)
    if not bool(run.all()):
        out = masked.argmax(1)
        keep = torch.nonzero(run).flatten()
        if keep.numel():
            out[keep] = _refined_labels(teacher_probs[keep], allowed[keep], imgs[keep.to(imgs.device)], refine,
                                        params, crf_backend)
        return out
    return _refined_labels(teacher_probs, allowed, imgs, refine, params, crf_backend)


def _refined_labels(teacher_probs: torch.Tensor, allowed: torch.Tensor, imgs: torch.Tensor, refine: str,
                    params: Mapping[str, Any], crf_backend: str) -> torch.Tensor:
    """:func:`teacher_labels`' refinement of a (B, C+1, H, W) batch over its allowed channels."""
    B, _, H, W = teacher_probs.shape
    n_allowed = allowed.sum(1)
    order = torch.sort((~allowed).to(torch.int8), dim=1, stable=True).indices[:, : int(n_allowed.max())]
    ok = torch.arange(order.shape[1], device=allowed.device)[None, :] < n_allowed[:, None]
    # float64 before the renormalisation and the clip, as these probabilities reached pydensecrf.
    p = teacher_probs.detach().double().gather(1, order[:, :, None, None].expand(-1, -1, H, W))
    p = p.masked_fill(~ok[:, :, None, None], 0)
    p = p / p.sum(1, keepdim=True).clamp_min(1e-12)
    # The CRF's arithmetic is float32 whatever the caller's autocast (a training loop under AMP
    # calls the teacher and this inside torch.autocast): its sparse products mix dtypes otherwise.
    with torch.autocast(p.device.type, enabled=False):
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
        debiased: (H, W) or (B, H, W) debiased labels Y^db with -1 = biased, 255 = ignore (a
            PNG written by :func:`mars_plugin.formats.files.write_label` stores -1 as 254: read it with
            :func:`mars_plugin.formats.files.read_label`).
        teacher_probs: (C+1, H, W) or (B, C+1, H, W) softmax of the EMA teacher (no grad
            needed), at the labels' height and width (upsample the logits first), C <= 253 (254
            and 255 are the biased and ignore bytes); an (H, W)
            label goes with (C+1, H, W) or (1, C+1, H, W).
        image_classes: (C,) / (B, C) multi-hot, or 1-based class-id lists (a flat list or a
            (C,) vector for one image, also with a batch of one).
        refine: None (argmax), ``"crf"`` (the dense CRF over the image's classes, batched on
            the probabilities' device; :func:`mars_plugin.engines.crf.dense_crf`) or ``"local_crf"``
            (its windowed approximation, :mod:`mars_plugin.engines.local_crf`).
        image: RGB images for ``refine="crf"|"local_crf"``, (B, H, W, 3) or (B, 3, H, W), uint8
            or [0, 1].
        crf_params: a preset name (``"mars"`` default, ``"psa"``) or a dict of overrides.
        crf_backend: ``"torch"`` or ``"pydensecrf"`` (the reference; CPU, per image).

    Returns:
        ``(complemented, certainty)``: complemented labels Y^co (long, -1 replaced by Y^te,
        everything else unchanged; the shape of ``debiased``) and W (float, same shape): the max over the image's
        foreground classes of ``teacher_probs`` where Y^db = -1 (0 for an image with no
        foreground class), 1 elsewhere. Both carry no gradient.
    """
    check_crf_backend(crf_backend)
    y, p, cls, single = _prepare(debiased, teacher_probs, image_classes, ignore_index)
    allowed = torch.cat([torch.ones_like(cls[:, :1]), cls], 1)
    biased = y == BIASED
    # the teacher's labels are used at biased pixels only: images without one skip the CRF
    y_te = teacher_labels(p, allowed, refine=refine, image=image, crf_params=crf_params, crf_backend=crf_backend,
                          needed=biased.flatten(1).any(1))
    complemented = torch.where(biased, y_te, y)
    fg = p[:, 1:].masked_fill(~cls[:, :, None, None], float("-inf")).max(1).values
    fg = fg.nan_to_num(neginf=0.0).clamp_min(0.0)
    certainty = torch.where(biased, fg, torch.ones_like(fg))
    if single:
        return complemented[0], certainty[0]
    return complemented, certainty
